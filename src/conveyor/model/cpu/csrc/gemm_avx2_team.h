/* The AVX2 GEMM of gemm_avx2.c, written once for each weight type: gemm_avx2.c includes this
 * file once per type after defining
 *
 *   GEMM_TEAM    the function's name (gemm_f32_f32_team_avx2, gemm_bf16_f32_team_avx2)
 *   W_T          the packed weights' element type
 *   KSTEP(k)     a panel's length in k as stored (K, or K rounded up to the pair for bf16)
 *   K_PER_LINE   k per 64-byte line of a panel (1 for float32, 2 for bf16 pairs)
 *   PREFETCH_ODD whether an odd k starts a line of its own (float32) or not (a bf16 pair)
 *   AHEAD_PREFETCH  whether the second row block prefetches the next one's lines
 *   LINE_AT(panel, kk, qs)              the line holding k = kk, lines qs elements apart
 *   LOAD_W(panel, kk, odd, qs, w0, w1)  columns 0-7 and 8-15 of k = kk as two __m256
 *   W_SPLIT      whether CpuLinear splits the middle of an odd number of groups (gemm_panels.h)
 *   SUFFIX       a token that keeps each instance's static helpers apart
 *
 * and undefines them afterwards. Panels sit in groups (panel_line0, panel_qs in
 * gemm_panels.h): a panel's consecutive lines are qs elements apart, the group's panels one
 * line apart (one panel per group: qs is a line). What the kernel does and why is in gemm.c.
 */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define MICRO_FN(R) CAT(CAT(micro, R), SUFFIX)
#define MICROS_TABLE CAT(micros, SUFFIX)
#define WIDE_FN(R) CAT(CAT(wide, R), SUFFIX)
#define WIDES_TABLE CAT(wides, SUFFIX)
#define LINE_ELEMS (64 / (int64_t)sizeof(W_T))
#define MICROS_ALL MICRO(6) MICRO(5) MICRO(4) MICRO(3) MICRO(2) MICRO(1)
#define MICROS_LIST                                                                            \
    0, MICRO_FN(1), MICRO_FN(2), MICRO_FN(3), MICRO_FN(4), MICRO_FN(5), MICRO_FN(6)

/* o[0..R) x [0..cols) (+)= x[0..R) x [0..kb) . panel[0..kb) x [0..16); first: start from
 * the bias (or 0) instead of o. */
#define MICRO(R)                                                                               \
    static void MICRO_FN(R)(const float *x, int64_t ldx, const W_T *panel, int64_t qs,         \
                            int64_t kb, const float *bias, int first, int prefetch, float *o,  \
                            int64_t ldo, int cols, const W_T *ahead, int64_t ahead_kb)         \
    {                                                                                          \
        enum { RR = R };                                                                       \
        __m256 b0 = _mm256_setzero_ps(), b1 = b0;                                              \
        if (first && bias) load_row(bias, cols, &b0, &b1);                                     \
        __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;                     \
        c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = b0;            \
        ROW_INIT(0) ROW_INIT(1) ROW_INIT(2) ROW_INIT(3) ROW_INIT(4) ROW_INIT(5)                 \
        int64_t kk = 0;                                                                        \
        for (; kk + 1 < kb; kk += 2) {                                                         \
            K_STEP(kk, 0)                                                                      \
            K_STEP(kk + 1, 1)                                                                  \
        }                                                                                      \
        if (kk < kb) K_STEP(kk, 0)                                                             \
        ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)          \
    }
#define K_STEP(k_, odd)                                                                        \
    {                                                                                          \
        const int64_t kx = (k_);                                                               \
        if (prefetch && (!(odd) || PREFETCH_ODD))                                              \
            _mm_prefetch((const char *)LINE_AT(panel, kx + PREFETCH_K, qs), _MM_HINT_T0);      \
        else if (ahead && kx < ahead_kb && (!(odd) || PREFETCH_ODD))                           \
            _mm_prefetch((const char *)LINE_AT(ahead, kx, qs), _MM_HINT_T0);                   \
        __m256 w0, w1;                                                                         \
        LOAD_W(panel, kx, odd, qs, w0, w1);                                                    \
        /* kept in registers: folded into each FMA, w is loaded 12 times a k besides the 6  \
         * broadcasts, and the load ports bound the block (docs/kernels.md#measured-choices) */\
        __asm__("" : "+x"(w0), "+x"(w1));                                                      \
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)                      \
    }
MICROS_ALL

/* One k of WIDE_FN(1) (odd: k is the second of its pair, a constant). */
#define WIDE_STEP(k_, odd)                                                                     \
    {                                                                                          \
        const int64_t kx = (k_);                                                               \
        const __m256 a = _mm256_broadcast_ss(x + kx);                                          \
        _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++) {                                 \
            const W_T *pj = panel + j * pstride;                                               \
            if (prefetch && (!(odd) || PREFETCH_ODD))                                          \
                _mm_prefetch((const char *)LINE_AT(pj, kx + PREFETCH_K, qs), _MM_HINT_T0);     \
            __m256 w0, w1;                                                                     \
            LOAD_W(pj, kx, odd, qs, w0, w1);                                                   \
            c[j][0] = _mm256_fmadd_ps(a, w0, c[j][0]);                                         \
            c[j][1] = _mm256_fmadd_ps(a, w1, c[j][1]);                                         \
        }                                                                                      \
    }
/* One row of x times the WIDE_P panels of one group, pstride apart (the last with `cols`
 * columns): 2 WIDE_P accumulators. Each output's sum is the same as in MICRO(1). */
static void WIDE_FN(1)(const float *x, int64_t pstride, const W_T *panel, int64_t qs, int64_t kb,
                       const float *bias, int first, int prefetch, float *o, int cols)
{
    enum { PP = WIDE_P };
    __m256 c[PP][2];
    _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++) {
        const int cj = j == PP - 1 ? cols : NR;
        c[j][0] = c[j][1] = _mm256_setzero_ps();
        if (!first)
            load_row(o + j * NR, cj, &c[j][0], &c[j][1]);
        else if (bias)
            load_row(bias + j * NR, cj, &c[j][0], &c[j][1]);
    }
    int64_t kk = 0;
    for (; kk + 1 < kb; kk += 2) {
        WIDE_STEP(kk, 0)
        WIDE_STEP(kk + 1, 1)
    }
    if (kk < kb) WIDE_STEP(kk, 0)
    _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++)
        store_row(o + j * NR, j == PP - 1 ? cols : NR, c[j][0], c[j][1]);
}

static void (*const MICROS_TABLE[MR + 1])(const float *, int64_t, const W_T *, int64_t, int64_t,
                                          const float *, int, int, float *, int64_t, int,
                                          const W_T *, int64_t) = {
    MICROS_LIST};
#undef MICRO

/* out[m, n] = x[m, k] . W^T + bias (bias may be NULL), the panels in groups of `group`
 * (PANEL_GROUP, or 1). Every thread of the running parallel region's team calls it (one
 * thread alone where the work is too small to split): the threads split the panels, and it
 * returns after the team's barrier (gemm.c's entry points, or decoder_layers.c's one region). */
void GEMM_TEAM(const float *x, int64_t ldx, int64_t m, const W_T *packed, int64_t n,
               int64_t k, const float *bias, float *out, int64_t ldo, int group)
{
    const int64_t panels = (n + NR - 1) / NR, lines = KSTEP(k) / K_PER_LINE;
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mb = m - m0 < MC ? m - m0 : MC;
        /* a few rows: WIDE_P panels, a row at a time */
        if (mb <= (K_PER_LINE == 1 ? WIDE2_R_F32 : WIDE2_R_BF16)) {
            const int64_t groups = (panels + WIDE_P - 1) / WIDE_P;
            #pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t p0 = g * WIDE_P;
                const int64_t np = panels - p0 < WIDE_P ? panels - p0 : WIDE_P;
                /* a whole group's four panels at once (not a middle group stored as two halves,
                 * gemm_panels.h's split_group: its panels one at a time) */
                const int whole = np == WIDE_P && !split_group(g, panels, group, W_SPLIT);
                for (int64_t k0 = 0; k0 == 0 || k0 < k; k0 += KC) { /* K = 0: the bias */
                    const int64_t kb = k - k0 < KC ? k - k0 : KC;
                    for (int64_t p = p0; p < p0 + np; p += (whole ? WIDE_P : 1)) {
                        const int64_t last = whole ? p + WIDE_P - 1 : p;
                        const int cols = (int)(n - last * NR < NR ? n - last * NR : NR);
                        const int64_t qs = panel_qs(p, panels, group, W_SPLIT) * LINE_ELEMS;
                        const int64_t line0 = panel_line0(p, lines, panels, group, W_SPLIT);
                        const W_T *panel = LINE_AT(packed + line0 * LINE_ELEMS, k0, qs);
                        const float *pbias = bias ? bias + p * NR : 0;
                        float *o = out + m0 * ldo + p * NR;
                        /* one group (WIDE_P is PANEL_GROUP), or panels one to a group */
                        const int64_t pstride = (group == 1 ? lines : 1) * LINE_ELEMS;
                        const float *xr = x + m0 * ldx + k0;
                        if (whole)
                            for (int64_t r = 0; r < mb; r++) /* the first one prefetches */
                                WIDE_FN(1)(xr + r * ldx, pstride, panel, qs, kb, pbias, k0 == 0,
                                           r == 0, o + r * ldo, cols);
                        else
                            for (int64_t r = 0; r < mb; r += MR)
                                MICROS_TABLE[mb - r < MR ? mb - r : MR](
                                    xr + r * ldx, ldx, panel, qs, kb, pbias, k0 == 0, r == 0,
                                    o + r * ldo, ldo, cols, 0, 0);
                    }
                }
            }
            continue;
        }
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
            const float *pbias = bias ? bias + p * NR : 0;
            float *o = out + m0 * ldo + p * NR;
            const int64_t qs = panel_qs(p, panels, group, W_SPLIT) * LINE_ELEMS;
            const W_T *first_line =
                packed + panel_line0(p, lines, panels, group, W_SPLIT) * LINE_ELEMS;
            for (int64_t k0 = 0; k0 == 0 || k0 < k; k0 += KC) { /* K = 0: the bias */
                const int64_t kb = k - k0 < KC ? k - k0 : KC;
                /* k0 is a multiple of KC, so even: a whole pair in bf16's layout */
                const W_T *panel = LINE_AT(first_line, k0, qs);
                for (int64_t r = 0; r < mb; r += MR) {
                    const int rows = (int)(mb - r < MR ? mb - r : MR);
                    /* With AHEAD_PREFETCH, the second row block (7 rows or more) prefetches
                     * what the next first one reads first (the next block of this panel, or
                     * the next panel's first), so the weights stream while it computes. */
                    const W_T *ahead = 0;
                    int64_t ahead_kb = 0;
                    const int fetch = AHEAD_PREFETCH && r == MR;
                    if (fetch && k0 + KC < k) {
                        ahead = LINE_AT(first_line, k0 + KC, qs);
                        ahead_kb = k - k0 - KC < KC ? k - k0 - KC : KC;
                    } else if (fetch && p + 1 < panels &&
                               panel_qs(p + 1, panels, group, W_SPLIT) * LINE_ELEMS == qs) {
                        ahead =
                            packed + panel_line0(p + 1, lines, panels, group, W_SPLIT) * LINE_ELEMS;
                        ahead_kb = k < KC ? k : KC;
                    }
                    MICROS_TABLE[rows](x + (m0 + r) * ldx + k0, ldx, panel, qs, kb, pbias,
                                       k0 == 0, r == 0, o + r * ldo, ldo, cols, ahead, ahead_kb);
                }
            }
        }
    }
}

#undef K_STEP
#undef WIDE_STEP
#undef LINE_ELEMS
#undef MICRO_FN
#undef MICROS_TABLE
#undef WIDE_FN
#undef WIDES_TABLE
#undef MICROS_ALL
#undef MICROS_LIST
#undef CAT
#undef CAT_

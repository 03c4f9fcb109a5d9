/* The AVX-512 GEMM of gemm_avx512.c, written once for each weight type: gemm_avx512.c
 * includes this file once per type after defining
 *
 *   GEMM_TEAM    the function's name (gemm_f32_f32_team_avx512, gemm_bf16_f32_team_avx512)
 *   W_T          the packed weights' element type
 *   KSTEP(k)     a panel's length in k as stored (K, or K rounded up to the pair for bf16)
 *   K_PER_LINE   k per 64-byte line of a panel (1 for float32, 2 for bf16 pairs)
 *   PREFETCH_ODD whether an odd k starts a line of its own (float32) or not (a bf16 pair)
 *   LINE_AT(panel, kk, qs)          the line holding k = kk, lines qs elements apart
 *   LOAD_W512(panel, kk, odd, qs)   the 16 columns of k = kk as one __m512 of floats
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
#define MICROS_ALL                                                                             \
    MICRO(16) MICRO(15) MICRO(14) MICRO(13) MICRO(12) MICRO(11) MICRO(10) MICRO(9) MICRO(8)   \
        MICRO(7) MICRO(6) MICRO(5) MICRO(4) MICRO(3) MICRO(2) MICRO(1)
#define MICROS_LIST                                                                            \
    0, MICRO_FN(1), MICRO_FN(2), MICRO_FN(3), MICRO_FN(4), MICRO_FN(5), MICRO_FN(6),          \
        MICRO_FN(7), MICRO_FN(8), MICRO_FN(9), MICRO_FN(10), MICRO_FN(11), MICRO_FN(12),      \
        MICRO_FN(13), MICRO_FN(14), MICRO_FN(15), MICRO_FN(16)
#define WIDES_ALL WIDE(4) WIDE(3) WIDE(2) WIDE(1)
#define WIDES_LIST 0, WIDE_FN(1), WIDE_FN(2), WIDE_FN(3), WIDE_FN(4)

/* o[0..R) x [0..cols) (+)= x[0..R) x [0..kb) . panel[0..kb) x [0..16); first: start from
 * the bias (or 0) instead of o. x is packed (pack_rows: row r of k at x[k * xs + r]). One
 * zmm accumulator per row; R is a constant in each instance, so the loops over rows unroll
 * and the accumulators stay in registers. The wide instances (P = WIDE panels, for a few
 * rows) take P panels of one group, pstride apart, the last with `cols` columns: more
 * independent accumulators, so a row or two do not wait on one FMA's latency per k; each
 * output's sum is the same as in one panel's instance. */
#define MICRO_P(R, P, NAME)                                                                    \
    static void NAME(const float *x, int64_t xs, int64_t pstride, const W_T *panel,           \
                     int64_t qs, int64_t kb, const float *bias, int first, int prefetch,       \
                     float *o, int64_t ldo, int cols)                                          \
    {                                                                                          \
        enum { RR = R, PP = P };                                                               \
        __mmask16 mask[PP];                                                                    \
        __m512 c[PP][RR];                                                                      \
        _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++) {                                 \
            mask[j] = j == PP - 1 ? (__mmask16)((1u << cols) - 1) : (__mmask16)0xFFFF;          \
            const __m512 b = first && bias ? _mm512_maskz_loadu_ps(mask[j], bias + j * NR)     \
                                           : _mm512_setzero_ps();                              \
            _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++) c[j][r] =                    \
                first ? b : _mm512_maskz_loadu_ps(mask[j], o + r * ldo + j * NR);              \
        }                                                                                      \
        int64_t kk = 0;                                                                        \
        for (; kk + 1 < kb; kk += 2) {                                                         \
            K_STEP512(kk, 0)                                                                   \
            K_STEP512(kk + 1, 1)                                                               \
        }                                                                                      \
        if (kk < kb) K_STEP512(kk, 0)                                                          \
        _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++)                                   \
            _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++)                              \
                _mm512_mask_storeu_ps(o + r * ldo + j * NR, mask[j], c[j][r]);                 \
    }
/* One k of the block (odd: k is the second of its pair, a constant); the prefetch runs
 * PREFETCH_LINES of its own lines ahead in each panel, once per 64-byte line. */
#define K_STEP512(k_, odd)                                                                     \
    {                                                                                          \
        const int64_t kx = (k_);                                                               \
        _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++) {                                 \
            const W_T *pj = panel + j * pstride;                                               \
            if (prefetch && (!(odd) || PREFETCH_ODD))                                          \
                _mm_prefetch((const char *)LINE_AT(pj, kx + PREFETCH_LINES * K_PER_LINE, qs),  \
                             _MM_HINT_T0);                                                     \
            const __m512 w = LOAD_W512(pj, kx, odd, qs);                                       \
            _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++) c[j][r] =                    \
                _mm512_fmadd_ps(_mm512_set1_ps(x[kx * xs + r]), w, c[j][r]);                   \
        }                                                                                      \
    }
#define MICRO(R) MICRO_P(R, 1, MICRO_FN(R))
#define WIDE(R) MICRO_P(R, WIDE_P, WIDE_FN(R))
MICROS_ALL
WIDES_ALL

static void (*const MICROS_TABLE[MR + 1])(const float *, int64_t, int64_t, const W_T *, int64_t,
                                          int64_t, const float *, int, int, float *, int64_t,
                                          int) = {MICROS_LIST};
static void (*const WIDES_TABLE[WIDE_R + 1])(const float *, int64_t, int64_t, const W_T *,
                                             int64_t, int64_t, const float *, int, int, float *,
                                             int64_t, int) = {WIDES_LIST};
#undef WIDE
#undef MICRO

/* out[m, n] = x[m, k] . W^T + bias (bias may be NULL), the panels in groups of `group`
 * (PANEL_GROUP, or 1). Every thread of the running parallel region's team calls it (one
 * thread alone where the work is too small to split): the threads split the panels, and it
 * returns after the team's barrier (gemm.c's entry points, or decoder_layers.c's one region). */
void GEMM_TEAM(const float *x, int64_t ldx, int64_t m, const W_T *packed, int64_t n,
               int64_t k, const float *bias, float *out, int64_t ldo, int group)
{
    const int64_t panels = (n + NR - 1) / NR, lines = KSTEP(k) / K_PER_LINE;
    /* x's block of rows packed once for every panel, by one thread into its buffer (NULL:
     * packed per micro-kernel call); a few short rows (a decode step) by each thread into a
     * buffer of its own on its stack, so the team meets once, at the end */
    const size_t block_rows = (size_t)((m < MC ? m : MC) + MR - 1) / MR * MR;
    const int own = m <= WIDE2_R && m * k <= OWN_PACK_WORDS;
    float own_xb[own ? m * k : 1];
    float *xb = own_xb;
    if (!own) {
        #pragma omp single copyprivate(xb)
        xb = pack_buffer(block_rows * (size_t)(k > 0 ? k : 1) * sizeof(float));
    }
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mb = m - m0 < MC ? m - m0 : MC;
        /* a few rows side by side (one row's k contiguous), more in blocks of MR */
        const int64_t xstride = mb <= WIDE2_R ? mb : MR;
        if (own) {
            pack_rows(x + m0 * ldx, ldx, mb, k, xb, xstride);
        } else {
            #pragma omp single
            if (xb) pack_rows(x + m0 * ldx, ldx, mb, k, xb, xstride);
        }
        if (mb <= WIDE2_R && xb) { /* a few rows: WIDE_P panels, WIDE_R rows at a time */
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
                        if (whole)
                            for (int64_t r = 0; r < mb; r += WIDE_R) /* the first ones prefetch */
                                WIDES_TABLE[mb - r < WIDE_R ? mb - r : WIDE_R](
                                    xb + k0 * xstride + r, xstride, pstride, panel, qs, kb, pbias,
                                    k0 == 0, r == 0, o + r * ldo, ldo, cols);
                        else
                            MICROS_TABLE[mb](xb + k0 * xstride, xstride, 0, panel, qs, kb, pbias,
                                             k0 == 0, 1, o, ldo, cols);
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
                    float xs[xb ? 1 : MR * KC];
                    const float *xr = xb + r * k + k0 * MR;
                    if (!xb) {
                        pack_rows(x + (m0 + r) * ldx + k0, ldx, rows, kb, xs, MR);
                        xr = xs;
                    }
                    MICROS_TABLE[rows](xr, MR, 0, panel, qs, kb, pbias, k0 == 0, r == 0,
                                       o + r * ldo, ldo, cols);
                }
            }
        }
    }
}

#undef K_STEP512
#undef LINE_ELEMS
#undef MICRO_FN
#undef MICROS_TABLE
#undef WIDE_FN
#undef WIDES_TABLE
#undef MICROS_ALL
#undef MICROS_LIST
#undef WIDES_ALL
#undef WIDES_LIST
#undef CAT
#undef CAT_

/* The GEMM of csrc/linear.c, written once for each weight type: linear.c includes this file
 * once per type after defining
 *
 *   GEMM_FN      the entry point's name
 *   W_T          the packed weights' element type
 *   KSTEP(k)     a panel's length in k as stored (K, or K rounded up to the pair for bf16)
 *   K_PER_LINE   k per 64-byte line of a panel (1 for float32, 2 for bf16 pairs)
 *   LINE_AT(panel, kk, qs)          the line holding k = kk, lines qs elements apart
 *   LOAD_W(panel, kk, odd, qs, w0, w1)   (AVX2) columns 0-7 and 8-15 of k = kk as two __m256
 *   LOAD_W512(panel, kk, odd, qs)        (AVX-512) the 16 columns of k = kk as one __m512
 *   W_AT(panel, kk, j, qs)          (portable) column j of k = kk as a float
 *   SUFFIX       a token that keeps each instance's static helpers apart
 *
 * Panels sit in groups (panel_line0, panel_qs in linear.c): a panel's consecutive lines are
 * qs elements apart, the group's panels one line apart (one panel per group: qs is a line).
 *
 * and undefines them afterwards. What the kernel does and why is in linear.c.
 */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define MICRO_FN(R) CAT(CAT(micro, R), SUFFIX)
#define MICROS_TABLE CAT(micros, SUFFIX)
#define WIDE_FN(R) CAT(CAT(wide, R), SUFFIX)
#define WIDES_TABLE CAT(wides, SUFFIX)
#define GEMM_GROUPED CAT(gemm_grouped, SUFFIX)
#define GEMM_TEAM CAT(gemm_team, SUFFIX)
#define LINE_ELEMS (64 / (int64_t)sizeof(W_T))

#if defined(CONVEYOR_GEMM512)

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

#elif defined(CONVEYOR_AVX2)

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

#endif

#if defined(CONVEYOR_AVX2)

#if defined(CONVEYOR_GEMM512) /* x packed, xs apart */
static void (*const MICROS_TABLE[MR + 1])(const float *, int64_t, int64_t, const W_T *, int64_t,
                                          int64_t, const float *, int, int, float *, int64_t,
                                          int) = {MICROS_LIST};
static void (*const WIDES_TABLE[WIDE_R + 1])(const float *, int64_t, int64_t, const W_T *,
                                             int64_t, int64_t, const float *, int, int, float *,
                                             int64_t, int) = {WIDES_LIST};
#undef WIDE
#else /* x's rows ldx apart */
static void (*const MICROS_TABLE[MR + 1])(const float *, int64_t, const W_T *, int64_t, int64_t,
                                          const float *, int, int, float *, int64_t, int,
                                          const W_T *, int64_t) = {
    MICROS_LIST};
#endif
#undef MICRO

/* out[m, n] = x[m, k] . W^T + bias (bias may be NULL), the panels in groups of `group`
 * (PANEL_GROUP, or 1). Every thread of the running parallel region's team calls it (one
 * thread alone where the work is too small to split): the threads split the panels, and it
 * returns after the team's barrier (GEMM_GROUPED below, or decoder_layers.c's one region). */
static void GEMM_TEAM(const float *x, int64_t ldx, int64_t m, const W_T *packed, int64_t n,
                      int64_t k, const float *bias, float *out, int64_t ldo, int group)
{
    const int64_t panels = (n + NR - 1) / NR, lines = KSTEP(k) / K_PER_LINE;
#if defined(CONVEYOR_GEMM512)
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
#endif
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mb = m - m0 < MC ? m - m0 : MC;
#if defined(CONVEYOR_GEMM512)
        /* a few rows side by side (one row's k contiguous), more in blocks of MR */
        const int64_t xstride = mb <= WIDE2_R ? mb : MR;
        if (own) {
            pack_rows(x + m0 * ldx, ldx, mb, k, xb, xstride);
        } else {
            #pragma omp single
            if (xb) pack_rows(x + m0 * ldx, ldx, mb, k, xb, xstride);
        }
#endif
#if defined(CONVEYOR_GEMM512)
        if (mb <= WIDE2_R && xb) { /* a few rows: WIDE_P panels, WIDE_R rows at a time */
#else
        /* a few rows: WIDE_P panels, a row at a time */
        if (mb <= (K_PER_LINE == 1 ? WIDE2_R_F32 : WIDE2_R_BF16)) {
#endif
            const int64_t groups = (panels + WIDE_P - 1) / WIDE_P;
            #pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t p0 = g * WIDE_P;
                const int64_t np = panels - p0 < WIDE_P ? panels - p0 : WIDE_P;
                /* a whole group's four panels at once (not a middle group stored as two halves,
                 * linear.c's split_group: its panels one at a time) */
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
#if defined(CONVEYOR_GEMM512)
                        if (whole)
                            for (int64_t r = 0; r < mb; r += WIDE_R) /* the first ones prefetch */
                                WIDES_TABLE[mb - r < WIDE_R ? mb - r : WIDE_R](
                                    xb + k0 * xstride + r, xstride, pstride, panel, qs, kb, pbias,
                                    k0 == 0, r == 0, o + r * ldo, ldo, cols);
                        else
                            MICROS_TABLE[mb](xb + k0 * xstride, xstride, 0, panel, qs, kb, pbias,
                                             k0 == 0, 1, o, ldo, cols);
#else
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
#endif
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
#if defined(CONVEYOR_GEMM512)
                    float xs[xb ? 1 : MR * KC];
                    const float *xr = xb + r * k + k0 * MR;
                    if (!xb) {
                        pack_rows(x + (m0 + r) * ldx + k0, ldx, rows, kb, xs, MR);
                        xr = xs;
                    }
                    MICROS_TABLE[rows](xr, MR, 0, panel, qs, kb, pbias, k0 == 0, r == 0,
                                       o + r * ldo, ldo, cols);
#else
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
#endif
                }
            }
        }
    }
}

#else

/* Portable build (no AVX2 + FMA: CONVEYOR_CPU_ISA=portable, an older x86-64, aarch64): the
 * same panels and the same sum per output (bias first, then k in order), PR rows at a time so
 * each weight load serves PR rows; the compiler vectorises the 16 columns with what the target
 * has (SSE2, NEON). Called by a team as above. */
static void GEMM_TEAM(const float *x, int64_t ldx, int64_t m, const W_T *packed, int64_t n,
                      int64_t k, const float *bias, float *out, int64_t ldo, int group)
{
    const int64_t panels = (n + NR - 1) / NR, lines = KSTEP(k) / K_PER_LINE;
    #pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
        const int64_t qs = panel_qs(p, panels, group, W_SPLIT) * LINE_ELEMS;
        const W_T *panel = packed + panel_line0(p, lines, panels, group, W_SPLIT) * LINE_ELEMS;
        for (int64_t r0 = 0; r0 < m; r0 += PR) {
            const int rows = (int)(m - r0 < PR ? m - r0 : PR);
            float acc[PR][NR];
            for (int r = 0; r < PR; r++)
                for (int j = 0; j < NR; j++)
                    acc[r][j] = bias && j < cols ? bias[p * NR + j] : 0.f;
            for (int64_t kk = 0; kk < k; kk++) {
                float w[NR];
                for (int j = 0; j < NR; j++) w[j] = W_AT(panel, kk, j, qs);
                for (int r = 0; r < rows; r++) {
                    const float a = x[(r0 + r) * ldx + kk];
                    for (int j = 0; j < NR; j++)
                        acc[r][j] += a * w[j];
                }
            }
            for (int r = 0; r < rows; r++)
                memcpy(out + (r0 + r) * ldo + p * NR, acc[r], cols * sizeof(float));
        }
    }
}

#endif

/* GEMM_TEAM on a team of its own: num_threads, or one thread for too little work. */
static void GEMM_GROUPED(const float *x, int64_t ldx, int64_t m, const W_T *packed, int64_t n,
                         int64_t k, const float *bias, float *out, int64_t ldo, int num_threads,
                         int group)
{
    #pragma omp parallel num_threads(num_threads) if (worth_a_team(m, n, k))
    GEMM_TEAM(x, ldx, m, packed, n, k, bias, out, ldo, group);
}

/* The entry point: CpuLinear's panels, in groups of PANEL_GROUP. */
void GEMM_FN(const float *x, int64_t ldx, int64_t m, const W_T *packed, int64_t n, int64_t k,
             const float *bias, float *out, int64_t ldo, int num_threads)
{
    GEMM_GROUPED(x, ldx, m, packed, n, k, bias, out, ldo, num_threads, PANEL_GROUP);
}

#undef K_STEP
#undef K_STEP512
#undef LINE_ELEMS
#undef GEMM_GROUPED
#undef GEMM_TEAM
#undef MICRO_FN
#undef MICROS_TABLE
#undef WIDE_FN
#undef WIDES_TABLE
#undef CAT
#undef CAT_

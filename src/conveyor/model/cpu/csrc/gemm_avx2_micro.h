/* The AVX2 micro-kernels of gemm_avx2.c for one weight form, and the calls gemm_team.h's
 * loops make (its header says what they take): gemm_team.h includes this file once per form
 * (GEMM_MICROS), after defining W_T, K_PER_LINE, LINE_AT, MICRO_FN(R), ... The form adds
 *
 *   LOAD_W(panel, kk, odd, qs, w0, w1)  columns 0-7 and 8-15 of k = kk as two __m256
 *   PREFETCH_ODD    whether an odd k starts a line of its own (float32) or not (a bf16 pair)
 *   AHEAD_PREFETCH  whether the second row block prefetches the next one's lines
 *
 * x is read where it is (rows ldx apart). */
#if W_FORM == W_F32
#define LOAD_W(panel, kk, odd, qs, w0, w1)                                                     \
    (w0 = _mm256_loadu_ps(LINE_AT(panel, kk, qs)), w1 = _mm256_loadu_ps(LINE_AT(panel, kk, qs) + 8))
#define AHEAD_PREFETCH 1 /* the second row block prefetches the next (kernels.md) */
#else /* bfloat16 (gemm_panels.h), widened */
#define LOAD_W(panel, kk, odd, qs, w0, w1)                                                     \
    do {                                                                                       \
        const __m256i *p_ = (const __m256i *)LINE_AT(panel, kk, qs);                           \
        const __m256i v0_ = _mm256_loadu_si256(p_), v1_ = _mm256_loadu_si256(p_ + 1);          \
        /* odd: the high halves, by two shifts: a mask would take a 16th ymm, and the 6 x 16  \
         * block then spills an accumulator every k (docs/kernels.md#measured-choices) */      \
        w0 = _mm256_castsi256_ps(_mm256_slli_epi32(odd ? _mm256_srli_epi32(v0_, 16) : v0_, 16)); \
        w1 = _mm256_castsi256_ps(_mm256_slli_epi32(odd ? _mm256_srli_epi32(v1_, 16) : v1_, 16)); \
    } while (0)
#define AHEAD_PREFETCH 0 /* no steady gain for bf16 (docs/kernels.md#measured-choices) */
#endif
#define PREFETCH_ODD (K_PER_LINE == 1) /* every k starts a 64-byte line, or a pair is one */
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

/* The calls of gemm_team.h's loops: a few rows (at most WIDE2_R_F32 / WIDE2_R_BF16) one at a
 * time by a group's panels, or one panel in 6 x 16 blocks; more in 6 x 16 blocks */
#define X_PACKED 0
#define FEW_ROWS(mb) ((mb) <= (K_PER_LINE == 1 ? WIDE2_R_F32 : WIDE2_R_BF16))
#define FEW_WIDE                                                                               \
    for (int64_t r = 0; r < mb; r++) /* the first one prefetches */                            \
        WIDE_FN(1)(x + m0 * ldx + k0 + r * ldx, pstride, panel, qs, kb, pbias, k0 == 0, r == 0, \
                   o + r * ldo, cols);
#define FEW_ONE                                                                                \
    for (int64_t r = 0; r < mb; r += MR)                                                       \
        MICROS_TABLE[mb - r < MR ? mb - r : MR](x + m0 * ldx + k0 + r * ldx, ldx, panel, qs, kb,  \
                                                pbias, k0 == 0, r == 0, o + r * ldo, ldo, cols, \
                                                0, 0);
#if AHEAD_PREFETCH
#define BLOCK                                                                                  \
    MICROS_TABLE[rows](x + (m0 + r) * ldx + k0, ldx, panel, qs, kb, pbias, k0 == 0, r == 0,    \
                       o + r * ldo, ldo, cols, ahead, ahead_kb);
#else
#define BLOCK                                                                                  \
    MICROS_TABLE[rows](x + (m0 + r) * ldx + k0, ldx, panel, qs, kb, pbias, k0 == 0, r == 0,    \
                       o + r * ldo, ldo, cols, 0, 0);
#endif

#undef K_STEP
#undef WIDE_STEP
#undef MICROS_ALL
#undef MICROS_LIST
#undef LOAD_W
#undef PREFETCH_ODD

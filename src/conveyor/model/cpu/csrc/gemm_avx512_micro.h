/* The AVX-512 micro-kernels of gemm_avx512.c (float32, bf16 widened) and gemm_avx512bf16.c
 * (bf16 pairs through vdpbf16ps) for one weight form, and the calls gemm_team.h's loops make
 * (its header says what they take): gemm_team.h includes this file once per form
 * (GEMM_MICROS), after defining W_T, K_PER_LINE, LINE_AT, MICRO_FN(R), ... x is packed
 * (pack_block, the including file's): X_T words, row r's step kk at x[kk xs + r]. */
#if W_FORM == W_PAIRS
#define X_T uint32_t /* a pair of x rounded to bf16 */
#else
#define X_T float
#endif
#define PREFETCH_ODD (K_PER_LINE == 1) /* every k starts a 64-byte line, or a pair is one */
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
 * the bias (or 0) instead of o. One zmm accumulator per row; R is a constant in each
 * instance, so the loops over rows unroll and the accumulators stay in registers. The wide
 * instances (P = WIDE panels, for a few rows) take P panels of one group, pstride apart, the
 * last with `cols` columns: more independent accumulators, so a row or two do not wait on one
 * FMA's latency per k; each output's sum is the same as in one panel's instance. */
#define MICRO_P(R, P, NAME)                                                                    \
    static void NAME(const X_T *x, int64_t xs, int64_t pstride, const W_T *panel, int64_t qs, \
                     int64_t kb, const float *bias, int first, int prefetch, float *o,         \
                     int64_t ldo, int cols)                                                    \
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
        K_LOOP                                                                                 \
        _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++)                                   \
            _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++)                              \
                _mm512_mask_storeu_ps(o + r * ldo + j * NR, mask[j], c[j][r]);                 \
    }
#if W_FORM == W_PAIRS
/* Each 32-bit lane takes a pair of k at once: x's pair (both rounded to bf16) times the
 * column's pair, one vdpbf16ps the work of two FMAs; the prefetch runs PREFETCH_LINES of its
 * own lines ahead in each panel. */
#define K_LOOP                                                                                 \
    for (int64_t q = 0; q < kb; q++) {                                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++) {                                 \
            const uint16_t *pj = panel + j * pstride + q * qs;                                 \
            if (prefetch) _mm_prefetch((const char *)(pj + PREFETCH_LINES * qs), _MM_HINT_T0); \
            const __m512bh w = (__m512bh)_mm512_loadu_si512(pj);                               \
            _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++) c[j][r] =                    \
                _mm512_dpbf16_ps(c[j][r], (__m512bh)_mm512_set1_epi32((int)x[q * xs + r]), w); \
        }                                                                                      \
    }
#else
#if W_FORM == W_F32
#define LOAD_W512(panel, kk, odd, qs) _mm512_loadu_ps(LINE_AT(panel, kk, qs))
#else /* bf16 widened: a shift left by 16 (even k) or a mask of the high halves (odd k) */
#define LOAD_W512(panel, kk, odd, qs)                                                          \
    _mm512_castsi512_ps(odd ? _mm512_and_si512(_mm512_loadu_si512(LINE_AT(panel, kk, qs)),     \
                                               _mm512_set1_epi32((int)0xFFFF0000u))            \
                            : _mm512_slli_epi32(_mm512_loadu_si512(LINE_AT(panel, kk, qs)), 16))
#endif
#define K_LOOP                                                                                 \
    int64_t kk = 0;                                                                            \
    for (; kk + 1 < kb; kk += 2) {                                                             \
        K_STEP512(kk, 0)                                                                       \
        K_STEP512(kk + 1, 1)                                                                   \
    }                                                                                          \
    if (kk < kb) K_STEP512(kk, 0)
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
#endif
#define MICRO(R) MICRO_P(R, 1, MICRO_FN(R))
#define WIDE(R) MICRO_P(R, WIDE_P, WIDE_FN(R))
MICROS_ALL
WIDES_ALL

typedef void (*CAT(micro_fn, SUFFIX))(const X_T *, int64_t, int64_t, const W_T *, int64_t,
                                      int64_t, const float *, int, int, float *, int64_t, int);
static const CAT(micro_fn, SUFFIX) MICROS_TABLE[MR + 1] = {MICROS_LIST};
static const CAT(micro_fn, SUFFIX) WIDES_TABLE[WIDE_R + 1] = {WIDES_LIST};
#if W_FORM == W_PAIRS /* and half of a group (gemm_avx512bf16.c's few_rows_dp) */
#define HALF(R) MICRO_P(R, HALF_P, CAT(CAT(half, R), SUFFIX))
HALF(4) HALF(3) HALF(2) HALF(1)
static const CAT(micro_fn, SUFFIX) CAT(halves, SUFFIX)[WIDE_R + 1] = {
    0, CAT(half1, SUFFIX), CAT(half2, SUFFIX), CAT(half3, SUFFIX), CAT(half4, SUFFIX)};
#undef HALF
#endif
#undef WIDE
#undef MICRO

/* The calls of gemm_team.h's loops: a few rows (at most WIDE2_R, side by side in xb)
 * WIDE_R at a time by a group's panels, or all of them by one panel; more in blocks of MR
 * (x packed per call on the stack where there is no buffer: xb NULL, F32 and BF16 only). */
#define X_PACKED 1
#define FEW_ROWS(mb) ((mb) <= WIDE2_R && xb)
#define FEW_WIDE                                                                               \
    for (int64_t r = 0; r < mb; r += WIDE_R) /* the first ones prefetch */                     \
        WIDES_TABLE[mb - r < WIDE_R ? mb - r : WIDE_R](xb + k0 * xs + r, xs, pstride, panel,   \
                                                       qs, kb, pbias, k0 == 0, r == 0,         \
                                                       o + r * ldo, ldo, cols);
#define FEW_ONE                                                                                \
    MICROS_TABLE[mb](xb + k0 * xs, xs, 0, panel, qs, kb, pbias, k0 == 0, 1, o, ldo, cols);
#if W_FORM == W_PAIRS
#define BLOCK                                                                                  \
    MICROS_TABLE[rows](xb + r * kl + k0 * MR, MR, 0, panel, qs, kb, pbias, k0 == 0, r == 0,    \
                       o + r * ldo, ldo, cols);
#else
#define BLOCK                                                                                  \
    {                                                                                          \
        float stack[xb ? 1 : MR * KC];                                                         \
        const float *xr = xb + r * kl + k0 * MR;                                               \
        if (!xb) {                                                                             \
            pack_rows(x + (m0 + r) * ldx + k0, ldx, rows, kb, stack, MR);                      \
            xr = stack;                                                                        \
        }                                                                                      \
        MICROS_TABLE[rows](xr, MR, 0, panel, qs, kb, pbias, k0 == 0, r == 0, o + r * ldo, ldo, \
                           cols);                                                              \
    }
#endif
#define AHEAD_PREFETCH 0

#undef K_LOOP
#undef K_STEP512
#undef LOAD_W512
#undef PREFETCH_ODD
#undef MICROS_ALL
#undef MICROS_LIST
#undef WIDES_ALL
#undef WIDES_LIST
#undef MICRO_P

/* The GEMM on bf16 panels through vdpbf16ps (AVX512-BF16; gemm.c's header): x rounded to
 * bf16 (nearest even) once per block of rows, each instruction two k per lane; the blocking
 * of gemm_avx512.c, and for a decode step the threads split the panels by halves of groups.
 */
#include "kernels.h"

#ifdef CONVEYOR_DPBF16

#include <immintrin.h>
#include <omp.h>

#include "gemm_panels.h"

/* bfloat16 weights through vdpbf16ps: each 32-bit lane of an accumulator takes a pair of k
 * at once, x's pair (both rounded to bf16, nearest even, as vcvtne2ps2bf16 does) times the
 * column's pair, so one instruction does the work of two FMAs. x's rows are rounded once per
 * block of rows into a buffer of pairs (an odd K's last pair padded with a zero, like the
 * panels). The sum per output is bias first, then the pairs in order; the same for a row
 * whatever batch it is in. */

/* x [k] float32 -> ceil(k / 2) words of bf16 pairs. */
static void round_pairs(const float *x, int64_t k, uint32_t *out)
{
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512(out + i / 2, (__m512i)v);
    }
    if (i < k) {
        const int rest = (int)(k - i);
        const __mmask16 lo = rest >= 16 ? 0xFFFF : (__mmask16)((1u << rest) - 1);
        const __mmask16 hi = rest > 16 ? (__mmask16)((1u << (rest - 16)) - 1) : 0;
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + i + 16),
                                               _mm512_maskz_loadu_ps(lo, x + i));
        _mm512_mask_storeu_epi32(out + i / 2, (__mmask16)((1u << ((rest + 1) / 2)) - 1),
                                 (__m512i)v);
    }
}

/* Row x [k] rounded to pairs and spread as the micro-kernels read it: pair q at
 * blk[q xs]. */
static void pack_pairs_row(const float *x, int64_t k, uint32_t *blk, int64_t xs)
{
    uint32_t words[16];
    for (int64_t i = 0; i < k; i += 32) {
        const int64_t len = k - i < 32 ? k - i : 32;
        round_pairs(x + i, len, words);
        for (int64_t q = 0; q < (len + 1) / 2; q++) blk[(i / 2 + q) * xs] = words[q];
    }
}

/* As MICRO_P in gemm_avx512_team.h, on pairs: row r's pair q at xp[q xs + r] (xs MR, as pack_rows
 * packs floats, or for a few rows their count, so that one row's pairs are not a cache line
 * each), the panel's pair q of its 16 columns one 64-byte line, qs uint16 after pair
 * q - 1's. */
#define MICRO_DP(R, P, NAME)                                                                   \
    static void NAME(const uint32_t *xp, int64_t xs, int64_t pstride, const uint16_t *panel,  \
                     int64_t qs,                                                               \
                     int64_t pairs, const float *bias, int first, int prefetch, float *o,      \
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
        for (int64_t q = 0; q < pairs; q++) {                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++) {                             \
                const uint16_t *pj = panel + j * pstride + q * qs;                             \
                if (prefetch) _mm_prefetch((const char *)(pj + PREFETCH_LINES * qs), _MM_HINT_T0); \
                const __m512bh w = (__m512bh)_mm512_loadu_si512(pj);                           \
                _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++) c[j][r] =                \
                    _mm512_dpbf16_ps(c[j][r], (__m512bh)_mm512_set1_epi32((int)xp[q * xs + r]), \
                                     w);                                                       \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++)                                   \
            _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++)                              \
                _mm512_mask_storeu_ps(o + r * ldo + j * NR, mask[j], c[j][r]);                 \
    }
MICRO_DP(16, 1, micro16_dp)
MICRO_DP(15, 1, micro15_dp)
MICRO_DP(14, 1, micro14_dp)
MICRO_DP(13, 1, micro13_dp)
MICRO_DP(12, 1, micro12_dp)
MICRO_DP(11, 1, micro11_dp)
MICRO_DP(10, 1, micro10_dp)
MICRO_DP(9, 1, micro9_dp)
MICRO_DP(8, 1, micro8_dp)
MICRO_DP(7, 1, micro7_dp)
MICRO_DP(6, 1, micro6_dp)
MICRO_DP(5, 1, micro5_dp)
MICRO_DP(4, 1, micro4_dp)
MICRO_DP(3, 1, micro3_dp)
MICRO_DP(2, 1, micro2_dp)
MICRO_DP(1, 1, micro1_dp)
MICRO_DP(4, WIDE_P, wide4_dp)
MICRO_DP(3, WIDE_P, wide3_dp)
MICRO_DP(2, WIDE_P, wide2_dp)
MICRO_DP(1, WIDE_P, wide1_dp)
MICRO_DP(4, HALF_P, half4_dp)
MICRO_DP(3, HALF_P, half3_dp)
MICRO_DP(2, HALF_P, half2_dp)
MICRO_DP(1, HALF_P, half1_dp)
#undef MICRO_DP

/* Long x (prefill): TR rows x TP panels of accumulators (24 zmm), each k pair's TP weight
 * vectors loaded once and each row's pair broadcast once into a register, then used TP
 * times: 11 loads for 24 vdpbf16ps where the 16 x 1 micro-kernel issues 17 loads for 16 (a
 * broadcast from memory is a load, so that kernel is bound by its loads). Each output's sum
 * is the same as in the micro-kernels (bias first, then the pairs in order): a row's result
 * does not depend on the path its batch takes. xp as micros_dp take it (rows MR apart). */
#define TR 8
#define TP 3
#define TQ 128 /* pairs per block: TP panels x 128 pairs x 64 B = 24 KiB, in L1 with x's */
/* From this many rows (a prefill chunk); a decode step's few rows stream the weights from
 * memory, where the micro-kernels' prefetching 16 x 1 blocks are as fast or faster
 * (docs/kernels.md#measured-choices). */
#define TILE_MIN_ROWS 64
static void tile_dp(const uint32_t *xp, const uint16_t *const panel[TP], const int64_t qs[TP],
                    int64_t pairs, const float *bias, int first, float *o, int64_t ldo, int rows)
{
    __m512 c[TR][TP];
    for (int j = 0; j < TP; j++) {
        const __m512 b = first && bias ? _mm512_loadu_ps(bias + j * NR) : _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (int r = 0; r < TR; r++) c[r][j] =
            first ? b : _mm512_loadu_ps(o + r * ldo + j * NR);
    }
    for (int64_t q = 0; q < pairs; q++) {
        __m512bh w[TP];
        _Pragma("GCC unroll 3") for (int j = 0; j < TP; j++) w[j] =
            (__m512bh)_mm512_loadu_si512(panel[j] + q * qs[j]);
        _Pragma("GCC unroll 8") for (int r = 0; r < TR; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xp[q * MR + r]);
            _Pragma("GCC unroll 3") for (int j = 0; j < TP; j++) c[r][j] =
                _mm512_dpbf16_ps(c[r][j], a, w[j]);
        }
    }
    for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 3") for (int j = 0; j < TP; j++)
            _mm512_storeu_ps(o + r * ldo + j * NR, c[r][j]);
}

typedef void (*micro_dp_fn)(const uint32_t *, int64_t, int64_t, const uint16_t *, int64_t,
                            int64_t, const float *, int, int, float *, int64_t, int);
static const micro_dp_fn micros_dp[MR + 1] = {
    0,          micro1_dp,  micro2_dp,  micro3_dp,  micro4_dp,  micro5_dp,
    micro6_dp,  micro7_dp,  micro8_dp,  micro9_dp,  micro10_dp, micro11_dp,
    micro12_dp, micro13_dp, micro14_dp, micro15_dp, micro16_dp};
static const micro_dp_fn wides_dp[WIDE_R + 1] = {0, wide1_dp, wide2_dp, wide3_dp, wide4_dp};
static const micro_dp_fn halves_dp[WIDE_R + 1] = {0, half1_dp, half2_dp, half3_dp, half4_dp};

/* Rows [0, mb) (at most WIDE2_R, packed in xp) times panels p .. p + np of CpuLinear's
 * groups: a whole group (np WIDE_P), half of one (HALF_P), or the panels after the last whole
 * group (tail: one at a time). Each output's sum is the same whichever. */
static void few_rows_dp(const uint32_t *xp, int64_t xs, int64_t kp, int64_t qc, int64_t mb,
                        int64_t p,
                        int64_t np, int tail, const uint16_t *packed, int64_t panels, int64_t n,
                        const float *bias, float *out, int64_t ldo)
{
    for (int64_t q0 = 0; q0 == 0 || q0 < kp; q0 += qc) { /* K = 0: the bias */
        const int64_t qb = kp - q0 < qc ? kp - q0 : qc;
        for (int64_t j = p; j < p + np; j += tail ? 1 : np) {
            const int64_t last = tail ? j : j + np - 1;
            const int cols = (int)(n - last * NR < NR ? n - last * NR : NR);
            const int64_t qs = panel_qs(j, panels, PANEL_GROUP, 1) * 2 * NR;
            const uint16_t *panel =
                packed + panel_line0(j, kp, panels, PANEL_GROUP, 1) * 2 * NR + q0 * qs;
            const float *pb = bias ? bias + j * NR : 0;
            if (tail) {
                micros_dp[mb](xp + q0 * xs, xs, 0, panel, qs, qb, pb, q0 == 0, 1, out + j * NR,
                              ldo, cols);
                continue;
            }
            const micro_dp_fn *fns = np == WIDE_P ? wides_dp : halves_dp;
            for (int64_t r = 0; r < mb; r += WIDE_R) /* the first ones prefetch */
                fns[mb - r < WIDE_R ? mb - r : WIDE_R](xp + q0 * xs + r, xs, 2 * NR, panel, qs, qb,
                                                        pb, q0 == 0, r == 0,
                                                        out + r * ldo + j * NR, ldo, cols);
        }
    }
}

/* out = x . W^T + bias on bf16 panels in groups of `group` (PANEL_GROUP: CpuLinear's; 1:
 * quant_gemm.c's slices). Every thread of the running parallel region's team calls it (one
 * thread alone where the work is too small to split), as the widening variants: x's rows are
 * rounded into one thread's buffer (a decode step's: each thread's own), the threads split
 * the panels, and it returns after the team's barrier. */
void gemm_bf16_bf16_team_avx512bf16(const float *x, int64_t ldx, int64_t m,
                                    const uint16_t *packed, int64_t n, int64_t k,
                                    const float *bias, float *out, int64_t ldo, int group)
{
    const int64_t panels = (n + NR - 1) / NR, kp = (k + 1) / 2, qc = KC;
    /* a block of rows in packed pairs */
    const size_t block_rows = (size_t)((m < MC ? m : MC) + MR - 1) / MR * MR;
    const size_t words = block_rows * (size_t)(kp ? kp : 1);
    /* A few short rows (a decode step): each thread rounds them into a buffer of its own on its
     * stack, so the team meets once, at the end, not also after one thread's rounding. */
    const int own = m <= WIDE2_R && m * kp <= OWN_PACK_WORDS;
    uint32_t own_xp[own ? m * kp : 1];
    uint32_t *xp = own_xp;
    if (!own) {
        #pragma omp single copyprivate(xp)
        xp = gemm_pack_buffer(words * sizeof *xp);
    }
    if (!xp) { /* no memory for the rounded rows: the widening kernel packs on the stack */
        gemm_bf16_f32_team_avx512(x, ldx, m, packed, n, k, bias, out, ldo, group);
        return;
    }
#define PANEL(p) (packed + panel_line0(p, kp, panels, group, 1) * 2 * NR) /* its pair 0 */
#define QS(p) (panel_qs(p, panels, group, 1) * 2 * NR)
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mb = m - m0 < MC ? m - m0 : MC;
        /* x's pairs: a few rows side by side (pair q of row r at xp[q mb + r], so one row's
         * pairs share cache lines, which the other threads read), more in blocks of MR */
        const int64_t xs = mb <= WIDE2_R ? mb : MR;
        if (own) {
            for (int64_t r = 0; r < mb; r++) pack_pairs_row(x + (m0 + r) * ldx, k, xp + r, xs);
        } else if (mb * k >= PACK_PARALLEL_MIN) {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < mb; r++)
                pack_pairs_row(x + (m0 + r) * ldx, k, xp + (r / xs) * xs * kp + r % xs, xs);
        } else {
            #pragma omp single
            for (int64_t r = 0; r < mb; r++)
                pack_pairs_row(x + (m0 + r) * ldx, k, xp + (r / xs) * xs * kp + r % xs, xs);
        }
        if (mb <= WIDE2_R && group == WIDE_P) {
            /* A few rows on CpuLinear's groups: each thread takes an equal share of the
             * groups' halves (the panels left over after the last whole group count as one
             * more), a whole group of WIDE_P panels at a time where it holds both halves, so
             * an odd number of groups does not leave one thread a group more to read. */
            const int64_t whole = panels / WIDE_P, halves = 2 * whole;
            const int64_t items = halves + (panels > whole * WIDE_P);
            {
                const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
                const int64_t end = items * (t + 1) / threads;
                for (int64_t u = items * t / threads; u < end;) {
                    const int64_t p = u < halves ? u * HALF_P : halves * HALF_P;
                    const int whole_group = u % 2 == 0 && u + 1 < end &&
                                            !split_group(u / 2, panels, WIDE_P, 1);
                    const int64_t np = u >= halves ? panels - p : whole_group ? WIDE_P : HALF_P;
                    few_rows_dp(xp, xs, kp, qc, mb, p, np, u >= halves, packed, panels, n, bias,
                                out + m0 * ldo, ldo);
                    u += u >= halves ? 1 : np / HALF_P;
                }
            }
            #pragma omp barrier
            continue;
        }
        if (mb <= WIDE2_R) { /* a few rows: WIDE_P panels at a time, WIDE_R rows at a time */
            const int64_t groups = (panels + WIDE_P - 1) / WIDE_P;
            #pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t p0 = g * WIDE_P;
                const int64_t np = panels - p0 < WIDE_P ? panels - p0 : WIDE_P;
                for (int64_t q0 = 0; q0 == 0 || q0 < kp; q0 += qc) { /* K = 0: the bias */
                    const int64_t qb = kp - q0 < qc ? kp - q0 : qc;
                    for (int64_t p = p0; p < p0 + np; p += (np == WIDE_P ? WIDE_P : 1)) {
                        const int64_t last = np == WIDE_P ? p + WIDE_P - 1 : p;
                        const int cols = (int)(n - last * NR < NR ? n - last * NR : NR);
                        const int64_t qs = QS(p);
                        const uint16_t *panel = PANEL(p) + q0 * qs;
                        const float *pb = bias ? bias + p * NR : 0;
                        if (np != WIDE_P) { /* the last panels, one at a time */
                            micros_dp[mb](xp + q0 * xs, xs, 0, panel, qs, qb, pb, q0 == 0, 1,
                                          out + m0 * ldo + p * NR, ldo, cols);
                            continue;
                        }
                        /* one group (WIDE_P is PANEL_GROUP), or panels one to a group */
                        const int64_t pstride = group == 1 ? kp * 2 * NR : 2 * NR;
                        for (int64_t r = 0; r < mb; r += WIDE_R) /* the first ones prefetch */
                            wides_dp[mb - r < WIDE_R ? mb - r : WIDE_R](
                                xp + q0 * xs + r, xs, pstride, panel, qs, qb, pb, q0 == 0, r == 0,
                                out + (m0 + r) * ldo + p * NR, ldo, cols);
                    }
                }
            }
            continue;
        }
        /* whole groups of TP full panels through tile_dp, TR rows at a time; the rest
         * (the last panels, a remainder of rows) through the micro-kernels */
        const int64_t full = n / NR, groups = mb >= TILE_MIN_ROWS ? full / TP : 0;
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t p = g * TP;
            const uint16_t *first[TP];
            int64_t qs[TP];
            for (int j = 0; j < TP; j++) first[j] = PANEL(p + j), qs[j] = QS(p + j);
            for (int64_t q0 = 0; q0 == 0 || q0 < kp; q0 += TQ) {
                const int64_t qb = kp - q0 < TQ ? kp - q0 : TQ;
                const uint16_t *panel[TP];
                for (int j = 0; j < TP; j++) panel[j] = first[j] + q0 * qs[j];
                int64_t r = 0;
                for (; r + TR <= mb; r += TR)
                    tile_dp(xp + (r / MR) * MR * kp + r % MR + q0 * MR, panel, qs, qb,
                            bias ? bias + p * NR : 0, q0 == 0, out + (m0 + r) * ldo + p * NR,
                            ldo, TR);
                for (int64_t j = 0; r < mb && j < TP; j++)
                    micros_dp[mb - r](xp + (r / MR) * MR * kp + r % MR + q0 * MR, MR, 0, panel[j],
                                      qs[j], qb, bias ? bias + (p + j) * NR : 0, q0 == 0, 0,
                                      out + (m0 + r) * ldo + (p + j) * NR, ldo, NR);
            }
        }
        #pragma omp for schedule(static)
        for (int64_t p = groups * TP; p < panels; p++) {
            const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
            const float *pbias = bias ? bias + p * NR : 0;
            float *o = out + m0 * ldo + p * NR;
            const int64_t qs = QS(p);
            for (int64_t q0 = 0; q0 == 0 || q0 < kp; q0 += qc) { /* K = 0: the bias */
                const int64_t qb = kp - q0 < qc ? kp - q0 : qc;
                const uint16_t *panel = PANEL(p) + q0 * qs;
                for (int64_t r = 0; r < mb; r += MR) {
                    const int rows = (int)(mb - r < MR ? mb - r : MR);
                    micros_dp[rows](xp + r * kp + q0 * MR, MR, 0, panel, qs, qb, pbias, q0 == 0,
                                    r == 0, o + r * ldo, ldo, cols);
                }
            }
        }
    }
#undef PANEL
#undef QS
}

#endif

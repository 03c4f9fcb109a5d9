/* The GEMM on bf16 panels through vdpbf16ps (AVX512-BF16; gemm.c's header): x rounded to
 * bf16 (nearest even) once per block of rows, each instruction two k per lane; the blocking
 * and the micro-kernels of gemm_avx512.c (gemm_avx512_micro.h's pairs form, gemm_team.h's
 * loops), a tile of TR x TP for long blocks, and for a decode step the threads split the
 * panels by halves of groups.
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

/* x's block of mb rows rounded to pairs for the micro-kernels (gemm_team.h): a few rows side
 * by side (pair q of row r at xp[q mb + r], so one row's pairs share cache lines, which the
 * other threads read), more in blocks of MR; by each thread into its own buffer (own), else
 * by the team (many values) or one thread. */
static inline __attribute__((always_inline)) void
pack_block(const float *x, int64_t ldx, int64_t mb, int64_t k, uint32_t *xp, int64_t xs, int own)
{
    const int64_t kp = (k + 1) / 2;
    if (own) {
        for (int64_t r = 0; r < mb; r++) pack_pairs_row(x + r * ldx, k, xp + r, xs);
    } else if (mb * k >= PACK_PARALLEL_MIN) {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < mb; r++)
            pack_pairs_row(x + r * ldx, k, xp + (r / xs) * xs * kp + r % xs, xs);
    } else {
        #pragma omp single
        for (int64_t r = 0; r < mb; r++)
            pack_pairs_row(x + r * ldx, k, xp + (r / xs) * xs * kp + r % xs, xs);
    }
}

/* After the micro-kernels (below the loops): a few rows on CpuLinear's groups by halves, and
 * a long block's tiles. */
static void few_rows_halves(const uint32_t *xp, int64_t xs, int64_t kp, int64_t mb,
                            const uint16_t *packed, int64_t panels, int64_t n, const float *bias,
                            float *out, int64_t ldo);
static inline int64_t tiles(const uint32_t *xp, int64_t kp, int64_t mb, const uint16_t *packed,
                            int64_t panels, int64_t n, const float *bias, float *out,
                            int64_t ldo, int group);

/* out = x . W^T + bias on bf16 panels in groups of `group` (PANEL_GROUP: CpuLinear's; 1:
 * quant_gemm.c's slices), as the widening variants: x's rows are rounded into one thread's
 * buffer (a decode step's: each thread's own; no memory for it: the widening kernel, which
 * packs on the stack). */
#define GEMM_MICROS "gemm_avx512_micro.h"
#define W_FORM W_PAIRS
#define GEMM_TEAM gemm_bf16_bf16_team_avx512bf16
#define X_MISSING                                                                              \
    if (!xb) {                                                                                 \
        gemm_bf16_f32_team_avx512(x, ldx, m, packed, n, k, bias, out, ldo, group);             \
        return;                                                                                \
    }
#define FEW_FIRST                                                                              \
    if (mb <= WIDE2_R && group == WIDE_P) {                                                    \
        few_rows_halves(xb, xs, kl, mb, packed, panels, n, bias, out + m0 * ldo, ldo);         \
        continue;                                                                              \
    }
#define TILES() tiles(xb, kl, mb, packed, panels, n, bias, out + m0 * ldo, ldo, group)
#include "gemm_team.h"
#undef GEMM_MICROS
#undef W_FORM
#undef GEMM_TEAM
#undef X_MISSING
#undef FEW_FIRST
#undef TILES

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
            const micro_fn_dp *fns = np == WIDE_P ? wides_dp : halves_dp;
            for (int64_t r = 0; r < mb; r += WIDE_R) /* the first ones prefetch */
                fns[mb - r < WIDE_R ? mb - r : WIDE_R](xp + q0 * xs + r, xs, 2 * NR, panel, qs, qb,
                                                        pb, q0 == 0, r == 0,
                                                        out + r * ldo + j * NR, ldo, cols);
        }
    }
}

/* A few rows on CpuLinear's groups: each thread takes an equal share of the groups' halves
 * (the panels left over after the last whole group count as one more), a whole group of
 * WIDE_P panels at a time where it holds both halves, so an odd number of groups does not
 * leave one thread a group more to read; it returns after the team's barrier. */
static void few_rows_halves(const uint32_t *xp, int64_t xs, int64_t kp, int64_t mb,
                            const uint16_t *packed, int64_t panels, int64_t n, const float *bias,
                            float *out, int64_t ldo)
{
    const int64_t whole = panels / WIDE_P, halves = 2 * whole;
    const int64_t items = halves + (panels > whole * WIDE_P);
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t end = items * (t + 1) / threads;
    for (int64_t u = items * t / threads; u < end;) {
        const int64_t p = u < halves ? u * HALF_P : halves * HALF_P;
        const int whole_group =
            u % 2 == 0 && u + 1 < end && !split_group(u / 2, panels, WIDE_P, 1);
        const int64_t np = u >= halves ? panels - p : whole_group ? WIDE_P : HALF_P;
        few_rows_dp(xp, xs, kp, KC, mb, p, np, u >= halves, packed, panels, n, bias, out, ldo);
        u += u >= halves ? 1 : np / HALF_P;
    }
    #pragma omp barrier
}

/* A long block (x's rows MR apart, from xp): whole groups of TP full panels through tile_dp,
 * TR rows at a time, the rest of their rows through the micro-kernels; returns the first
 * panel the blocks of gemm_team.h's loops take (the last panels). */
static inline int64_t tiles(const uint32_t *xp, int64_t kp, int64_t mb, const uint16_t *packed,
                            int64_t panels, int64_t n, const float *bias, float *out,
                            int64_t ldo, int group)
{
#define PANEL(p) (packed + panel_line0(p, kp, panels, group, 1) * 2 * NR) /* its pair 0 */
#define QS(p) (panel_qs(p, panels, group, 1) * 2 * NR)
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
                        bias ? bias + p * NR : 0, q0 == 0, out + r * ldo + p * NR, ldo, TR);
            for (int64_t j = 0; r < mb && j < TP; j++)
                micros_dp[mb - r](xp + (r / MR) * MR * kp + r % MR + q0 * MR, MR, 0, panel[j],
                                  qs[j], qb, bias ? bias + (p + j) * NR : 0, q0 == 0, 0,
                                  out + r * ldo + (p + j) * NR, ldo, NR);
        }
    }
    return groups * TP;
#undef PANEL
#undef QS
}

#endif

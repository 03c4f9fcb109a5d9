/* The GEMM on AVX2 + FMA without AVX-512 (gemm.c's header): a 6 x 16 block of out in twelve
 * ymm registers; for each k the panel's 16 weights are loaded once (two vectors) and one x
 * value per row broadcast: 12 FMAs for 8 loads, the classic shape for 16 vector registers;
 * for 1-3 rows (decode) one row by a group's four panels at a time instead. bf16 weights are
 * widened to float32 in registers (the same float32 products and sums). gemm_avx2_team.h is
 * the kernel, once per weight type.
 */
#include "kernels.h"

#if defined(CONVEYOR_AVX2) && !defined(CONVEYOR_GEMM512)

#include <immintrin.h>
#include <string.h>

#include "gemm_panels.h"

#define MR 6
#define MC 288 /* a multiple of MR: 288 x 256 floats of x, 288 KiB */
#define PREFETCH_K 32 /* k steps (64 B of float32 each) ahead (16, 64, 128: level) */
/* A few rows (a decode step of at most WIDE2_R_F32 / WIDE2_R_BF16 sequences) take a group's
 * WIDE_P panels together, one row at a time (8 accumulators: 16 ymm registers hold no second
 * row), the later rows re-reading the group's block from L1/L2: the group streams as one, and
 * the row's sums are eight independent FMA chains, not two waiting on each other's latency
 * per k. From one row more (bf16 widens its weights again for every row) the 6 x 16 blocks
 * are as fast or faster (docs/kernels.md#measured-choices). */
#define WIDE_P 4 /* PANEL_GROUP */
#define WIDE2_R_F32 3
#define WIDE2_R_BF16 2

static inline __attribute__((always_inline)) void load_row(const float *o, int cols, __m256 *a0,
                                                           __m256 *a1)
{
    if (cols == NR) {
        *a0 = _mm256_loadu_ps(o);
        *a1 = _mm256_loadu_ps(o + 8);
    } else {
        float tmp[NR] = {0};
        memcpy(tmp, o, cols * sizeof(float));
        *a0 = _mm256_loadu_ps(tmp);
        *a1 = _mm256_loadu_ps(tmp + 8);
    }
}

static inline __attribute__((always_inline)) void store_row(float *o, int cols, __m256 a0,
                                                            __m256 a1)
{
    if (cols == NR) {
        _mm256_storeu_ps(o, a0);
        _mm256_storeu_ps(o + 8, a1);
    } else {
        float tmp[NR];
        _mm256_storeu_ps(tmp, a0);
        _mm256_storeu_ps(tmp + 8, a1);
        memcpy(o, tmp, cols * sizeof(float));
    }
}

/* Rows r < R of the 6 x 16 block; R is a constant in each instance, so the compiler drops
 * the rest and keeps the accumulators in registers. */
#define ROW_INIT(r)                                                                            \
    if (RR > r) {                                                                              \
        if (first)                                                                             \
            c##r##0 = b0, c##r##1 = b1;                                                        \
        else                                                                                   \
            load_row(o + r * ldo, cols, &c##r##0, &c##r##1);                                   \
    }
#define ROW_FMA(r)                                                                             \
    if (RR > r) {                                                                              \
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + kx);                                \
        c##r##0 = _mm256_fmadd_ps(a, w0, c##r##0);                                             \
        c##r##1 = _mm256_fmadd_ps(a, w1, c##r##1);                                             \
    }
#define ROW_STORE(r)                                                                           \
    if (RR > r) store_row(o + r * ldo, cols, c##r##0, c##r##1);


/* float32 weights: [panels][K][16] floats. */
#define GEMM_TEAM gemm_f32_f32_team_avx2
#define W_T float
#define SUFFIX _f32
#define KSTEP(k) (k)
#define K_PER_LINE 1
#define PREFETCH_ODD 1 /* every k starts a 64-byte line */
#define AHEAD_PREFETCH 1 /* the second row block prefetches the next (kernels.md) */
#define LINE_AT(panel, kk, qs) ((panel) + (kk) * (qs))
#define LOAD_W(panel, kk, odd, qs, w0, w1)                                                     \
    (w0 = _mm256_loadu_ps(LINE_AT(panel, kk, qs)), w1 = _mm256_loadu_ps(LINE_AT(panel, kk, qs) + 8))
#define W_SPLIT 0 /* float32 groups are never split */
#include "gemm_avx2_team.h"
#undef GEMM_TEAM
#undef W_T
#undef W_SPLIT
#undef SUFFIX
#undef KSTEP
#undef K_PER_LINE
#undef PREFETCH_ODD
#undef AHEAD_PREFETCH
#undef LINE_AT
#undef LOAD_W

/* bfloat16 weights (gemm_panels.h), widened. */
#define GEMM_TEAM gemm_bf16_f32_team_avx2
#define W_T uint16_t
#define SUFFIX _bf16
#define KSTEP(k) ((k) + ((k) & 1))
#define K_PER_LINE 2
#define PREFETCH_ODD 0 /* a pair of k is one 64-byte line */
#define AHEAD_PREFETCH 0 /* no steady gain for bf16 (docs/kernels.md#measured-choices) */
#define LINE_AT(panel, kk, qs) ((panel) + ((kk) >> 1) * (qs))
#define LOAD_W(panel, kk, odd, qs, w0, w1)                                                     \
    do {                                                                                       \
        const __m256i *p_ = (const __m256i *)LINE_AT(panel, kk, qs);                           \
        const __m256i v0_ = _mm256_loadu_si256(p_), v1_ = _mm256_loadu_si256(p_ + 1);          \
        /* odd: the high halves, by two shifts: a mask would take a 16th ymm, and the 6 x 16  \
         * block then spills an accumulator every k (docs/kernels.md#measured-choices) */      \
        w0 = _mm256_castsi256_ps(_mm256_slli_epi32(odd ? _mm256_srli_epi32(v0_, 16) : v0_, 16)); \
        w1 = _mm256_castsi256_ps(_mm256_slli_epi32(odd ? _mm256_srli_epi32(v1_, 16) : v1_, 16)); \
    } while (0)
#define W_SPLIT SPLIT_BF16 /* CpuLinear's layout for this build's bf16 panels */
#include "gemm_avx2_team.h"
#undef GEMM_TEAM
#undef W_T
#undef W_SPLIT
#undef SUFFIX
#undef KSTEP
#undef K_PER_LINE
#undef PREFETCH_ODD
#undef AHEAD_PREFETCH
#undef LINE_AT
#undef LOAD_W

#endif

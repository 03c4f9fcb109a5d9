/* The GEMM on AVX2 + FMA without AVX-512 (gemm.c's header): a 6 x 16 block of out in twelve
 * ymm registers; for each k the panel's 16 weights are loaded once (two vectors) and one x
 * value per row broadcast: 12 FMAs for 8 loads, the classic shape for 16 vector registers;
 * for 1-3 rows (decode) one row by a group's four panels at a time instead. bf16 weights are
 * widened to float32 in registers (the same float32 products and sums). gemm_avx2_micro.h has
 * the micro-kernels and gemm_team.h the loops, once per weight type.
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


/* float32 weights: [panels][K][16] floats; bfloat16 (gemm_panels.h), widened. */
#define GEMM_MICROS "gemm_avx2_micro.h"
#define W_FORM W_F32
#define GEMM_TEAM gemm_f32_f32_team_avx2
#include "gemm_team.h"
#undef W_FORM
#undef GEMM_TEAM
#define W_FORM W_BF16
#define GEMM_TEAM gemm_bf16_f32_team_avx2
#include "gemm_team.h"
#undef W_FORM
#undef GEMM_TEAM
#undef GEMM_MICROS

#endif

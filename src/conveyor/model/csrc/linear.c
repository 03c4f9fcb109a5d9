/* Linear layers for CPU: out = x @ W^T + bias, x, bias and out float32, with W [N, K] packed
 * once at load into panels of NR = 16 output columns, [ceil(N / 16)][K][16] (the last panel
 * zero-padded; conveyor.model.linear.CpuLinear packs it), in float32 (conveyor_linear_f32) or
 * bfloat16 (conveyor_linear_bf16: half the bytes to stream, each weight widened to float32 in
 * registers; the same float32 products and sums). linear_gemm.h is the kernel, once per type.
 *
 * The micro-kernel keeps a 6 x 16 block of out in twelve AVX2 registers and, for each k,
 * loads the panel's 16 weights once (two vectors) and broadcasts one x value per row: 12
 * FMAs for 8 loads, the classic shape for 16 vector registers. Each output is one fp32 sum
 * over k in order (bias first), so a row's result does not depend on the batch it is in,
 * and it matches torch's to fp32 rounding.
 *
 * Blocking: rows in blocks of MC (x's block stays in L2 while every panel passes over it),
 * K in blocks of KC (a panel's block of 16 x KC weights stays in L1/L2 while the row blocks
 * of 6 reuse it; the partial sums wait in out). Threads split the panels. The first row
 * block of each panel prefetches the weights ahead of it: at decode batch sizes (a few to a
 * few dozen rows) the weights stream from DRAM once per step and this is what bounds a step.
 *
 * Measured on our 2-core box (Zen 4, AVX2 only), every linear of SmolLM2-135M's shape back to
 * back (cold weights), against oneDNN with its own prepacked weights: 1 row 15.4 vs 31.9 ms,
 * 4 rows 17.8 vs 40.5, 16 rows 48.3 vs 68.3, 64 rows 174 vs 191; at prefill sizes (4 layers
 * and the head, 97 to 2048 rows) within -8 % to +15 % of oneDNN from run to run.
 */
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

#define NR 16
#define MR 6
#define MC 288 /* a multiple of MR: 288 x 256 floats of x, 288 KiB */
#define KC 256 /* a panel's block: 16 KiB */
#define PREFETCH_K 32 /* k steps (64 B each) ahead */
#define PARALLEL_MIN_FLOPS (1 << 16)

#ifdef CONVEYOR_AVX2

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
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + kk);                                \
        c##r##0 = _mm256_fmadd_ps(a, w0, c##r##0);                                             \
        c##r##1 = _mm256_fmadd_ps(a, w1, c##r##1);                                             \
    }
#define ROW_STORE(r)                                                                           \
    if (RR > r) store_row(o + r * ldo, cols, c##r##0, c##r##1);

#else
#define PR 4 /* the portable loop's rows per weight load */
#endif

/* float32 weights: [panels][K][16] floats. */
#define GEMM_FN conveyor_linear_f32
#define W_T float
#define SUFFIX _f32
#define LOAD_W(wk, w0, w1) (w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps((wk) + 8))
#define W_AT(wk, j) ((wk)[j])
#include "linear_gemm.h"
#undef GEMM_FN
#undef W_T
#undef SUFFIX
#undef LOAD_W
#undef W_AT

/* bfloat16 weights: [panels][K][16] uint16, each k's 16 interleaved so that 32-bit word j
 * holds column j in its low half and column 8 + j in its high half (CpuLinear packs them so).
 * A bf16 is the top half of its float32, so one 256-bit load gives both halves of the panel
 * in two integer operations: a shift left by 16 (columns 0-7) and a mask of the high halves
 * (8-15). The products and sums are float32, as with float32 weights. */
static inline float bf16_at(const uint16_t *wk, int j)
{
    const uint32_t bits = (uint32_t)wk[j < 8 ? 2 * j : 2 * (j - 8) + 1] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#define GEMM_FN conveyor_linear_bf16
#define W_T uint16_t
#define SUFFIX _bf16
#define LOAD_W(wk, w0, w1)                                                                     \
    do {                                                                                       \
        const __m256i v_ = _mm256_loadu_si256((const __m256i *)(wk));                          \
        w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v_, 16));                                   \
        w1 = _mm256_castsi256_ps(_mm256_and_si256(v_, _mm256_set1_epi32((int)0xFFFF0000u)));   \
    } while (0)
#define W_AT(wk, j) bf16_at(wk, j)
#include "linear_gemm.h"
#undef GEMM_FN
#undef W_T
#undef SUFFIX
#undef LOAD_W
#undef W_AT

/* Whether this build's GEMM is the AVX2 + FMA kernel (else the portable loop above). */
int conveyor_linear_f32_vectorized(void)
{
#ifdef CONVEYOR_AVX2
    return 1;
#else
    return 0;
#endif
}

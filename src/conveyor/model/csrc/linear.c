/* Linear layers for CPU, float32: out = x @ W^T + bias, with W [N, K] packed once at load
 * into panels of NR = 16 output columns, [ceil(N / 16)][K][16] (the last panel zero-padded;
 * conveyor.model.linear.CpuLinear packs it).
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

/* o[0..R) x [0..cols) (+)= x[0..R) x [0..kb) . panel[0..kb) x [0..16); first: start from
 * the bias (or 0) instead of o. */
#define MICRO(R)                                                                               \
    static void micro##R(const float *x, int64_t ldx, const float *panel, int64_t kb,           \
                         const float *bias, int first, int prefetch, float *o, int64_t ldo,    \
                         int cols)                                                             \
    {                                                                                          \
        enum { RR = R };                                                                       \
        __m256 b0 = _mm256_setzero_ps(), b1 = b0;                                              \
        if (first && bias) load_row(bias, cols, &b0, &b1);                                     \
        __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;                     \
        c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = b0;            \
        ROW_INIT(0) ROW_INIT(1) ROW_INIT(2) ROW_INIT(3) ROW_INIT(4) ROW_INIT(5)                 \
        for (int64_t kk = 0; kk < kb; kk++) {                                                  \
            const float *wk = panel + kk * NR;                                                 \
            if (prefetch) _mm_prefetch((const char *)(wk + PREFETCH_K * NR), _MM_HINT_T0);    \
            const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);               \
            ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)                  \
        }                                                                                      \
        ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)          \
    }
MICRO(6)
MICRO(5)
MICRO(4)
MICRO(3)
MICRO(2)
MICRO(1)

typedef void (*micro_fn)(const float *, int64_t, const float *, int64_t, const float *, int, int,
                         float *, int64_t, int);
static const micro_fn MICROS[MR + 1] = {0, micro1, micro2, micro3, micro4, micro5, micro6};

/* out[m, n] = x[m, k] . W^T + bias (bias may be NULL). */
void conveyor_linear_f32(const float *x, int64_t ldx, int64_t m, const float *packed, int64_t n,
                        int64_t k, const float *bias, float *out, int64_t ldo, int num_threads)
{
    const int64_t panels = (n + NR - 1) / NR;
    const int parallel = panels > 1 && 2 * m * n * k >= PARALLEL_MIN_FLOPS;
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mb = m - m0 < MC ? m - m0 : MC;
        #pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
        for (int64_t p = 0; p < panels; p++) {
            const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
            const float *pbias = bias ? bias + p * NR : 0;
            float *o = out + m0 * ldo + p * NR;
            for (int64_t k0 = 0; k0 == 0 || k0 < k; k0 += KC) { /* K = 0: the bias */
                const int64_t kb = k - k0 < KC ? k - k0 : KC;
                const float *panel = packed + (p * k + k0) * NR;
                for (int64_t r = 0; r < mb; r += MR) {
                    const int rows = (int)(mb - r < MR ? mb - r : MR);
                    MICROS[rows](x + (m0 + r) * ldx + k0, ldx, panel, kb, pbias, k0 == 0,
                                 r == 0, o + r * ldo, ldo, cols);
                }
            }
        }
    }
}

#else

/* Portable build (no AVX2 + FMA: CONVEYOR_CPU_ISA=portable, an older x86-64, aarch64): the
 * same panels and the same sum per output (bias first, then k in order), PR rows at a time so
 * each weight load serves PR rows; the compiler vectorises the 16 columns with what the target
 * has (SSE2, NEON). Correct everywhere, but oneDNN is faster than it, so
 * conveyor_linear_f32_vectorized() says 0 and linear_backend "auto" picks oneDNN there. */
#define PR 4

void conveyor_linear_f32(const float *x, int64_t ldx, int64_t m, const float *packed, int64_t n,
                        int64_t k, const float *bias, float *out, int64_t ldo, int num_threads)
{
    const int64_t panels = (n + NR - 1) / NR;
    const int parallel = panels > 1 && 2 * m * n * k >= PARALLEL_MIN_FLOPS;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t p = 0; p < panels; p++) {
        const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
        const float *panel = packed + p * k * NR;
        for (int64_t r0 = 0; r0 < m; r0 += PR) {
            const int rows = (int)(m - r0 < PR ? m - r0 : PR);
            float acc[PR][NR];
            for (int r = 0; r < PR; r++)
                for (int j = 0; j < NR; j++)
                    acc[r][j] = bias && j < cols ? bias[p * NR + j] : 0.f;
            for (int64_t kk = 0; kk < k; kk++) {
                const float *wk = panel + kk * NR;
                for (int r = 0; r < rows; r++) {
                    const float a = x[(r0 + r) * ldx + kk];
                    for (int j = 0; j < NR; j++)
                        acc[r][j] += a * wk[j];
                }
            }
            for (int r = 0; r < rows; r++)
                memcpy(out + (r0 + r) * ldo + p * NR, acc[r], cols * sizeof(float));
        }
    }
}

#endif

/* Whether this build's GEMM is the AVX2 + FMA kernel (else the portable loop above). */
int conveyor_linear_f32_vectorized(void)
{
#ifdef CONVEYOR_AVX2
    return 1;
#else
    return 0;
#endif
}

/* The GEMM on AVX-512 (gemm.c's header): 16 columns are one zmm, up to 16 rows x 16 columns
 * of accumulators, x's block of rows packed first (pack_rows) so the values broadcast for one
 * k share a cache line; for 1-16 rows (decode) four panels per call, four rows at a time, so
 * a step is not bound by one FMA chain's latency per k. bf16 weights are widened to float32
 * in registers (the same float32 products and sums as float32 weights); gemm_avx512bf16.c
 * has the vdpbf16ps kernel. gemm_avx512_micro.h has the micro-kernels and gemm_team.h the
 * loops, once per weight type.
 */
#include "kernels.h"

#ifdef CONVEYOR_GEMM512

#include <immintrin.h>
#include <stdlib.h>

#include "gemm_panels.h"

/* Rows [0, mb) of x (k columns) packed by blocks of xs rows (MR, or a few rows' count; out
 * holds mb rounded up to xs rows), block b at out + b xs k and its row r's column kk at
 * [kk xs + r]: the values a micro-kernel broadcasts for one k sit in one cache line, wherever
 * x's rows are (rows a power-of-two stride apart would all fall in one L1 set), and a single
 * row's k are contiguous, not a line each (which the other threads would pull one by one). */
static void pack_rows(const float *x, int64_t ldx, int64_t mb, int64_t k, float *out,
                      int64_t xs)
{
    for (int64_t r = 0; r < mb; r++) {
        float *blk = out + (r / xs) * xs * k + r % xs;
        const float *row = x + r * ldx;
        for (int64_t kk = 0; kk < k; kk++) blk[kk * xs] = row[kk];
    }
}

/* x's block of mb rows packed for the micro-kernels (gemm_team.h): by each thread into its own
 * buffer (own), else by one thread into the shared one (none: NULL). */
static inline __attribute__((always_inline)) void
pack_block(const float *x, int64_t ldx, int64_t mb, int64_t k, float *xb, int64_t xs, int own)
{
    if (own) {
        pack_rows(x, ldx, mb, k, xb, xs);
    } else {
        #pragma omp single
        if (xb) pack_rows(x, ldx, mb, k, xb, xs);
    }
}

/* float32 weights: [panels][K][16] floats; bfloat16 (gemm_panels.h), widened. */
#define GEMM_MICROS "gemm_avx512_micro.h"
#define W_FORM W_F32
#define GEMM_TEAM gemm_f32_f32_team_avx512
#include "gemm_team.h"
#undef W_FORM
#undef GEMM_TEAM
#define W_FORM W_BF16
#define GEMM_TEAM gemm_bf16_f32_team_avx512
#include "gemm_team.h"
#undef W_FORM
#undef GEMM_TEAM
#undef GEMM_MICROS

#endif

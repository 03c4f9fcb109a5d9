/* The gated MLP's activation for CPU, float32: out = silu(gate) * up in one pass, where
 * gate_up = [gate | up] is the fused gate/up projection's output ([rows, 2 I]) and out is
 * [rows, I] (conveyor.model.models.layers.GatedMLP; its reference is torch's F.silu(gate) * up).
 *
 *     silu(x) = x * sigmoid(x),  sigmoid(x) = 1 / (1 + e^-|x|)  or  e^-|x| / (1 + e^-|x|)
 *
 * e^-|x| <= 1 never overflows; with AVX2 (silu_mul_avx2.c) it is vec_math.h's vector e^x
 * (within 1 ulp of expf), so results agree with torch's to fp32 rounding. Rows are split over OpenMP threads
 * only when there is enough work: from 8192 elements, a quarter of RMSNorm's threshold
 * because an element costs an e^x and a division (docs/kernels.md#measured-choices).
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#define PARALLEL_MIN_ELEMENTS (1 << 13)

static inline float silu_mul(float g, float u)
{
    const float e = expf(-fabsf(g));
    const float sig = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    return g * sig * u;
}

/* Every thread of a running parallel region calls it (decoder_layers.c): the rows split among
 * the team, returning after its barrier. */
void silu_mul_f32_team(const float *gate_up, int64_t in_stride, float *out, int64_t out_stride,
                       int64_t rows, int inter)
{
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *g = gate_up + i * in_stride, *u = g + inter;
        float *o = out + i * out_stride;
        int e = 0;
#ifdef CONVEYOR_AVX2
        e = silu_mul_row_f32_avx2(g, u, o, inter);
#endif
        for (; e < inter; e++) o[e] = silu_mul(g[e], u[e]);
    }
}

CONVEYOR_EXPORT void silu_mul_f32(const float *gate_up, int64_t in_stride, float *out,
                                  int64_t out_stride, int64_t rows, int inter, int num_threads)
{
    #pragma omp parallel num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    silu_mul_f32_team(gate_up, in_stride, out, out_stride, rows, inter);
}

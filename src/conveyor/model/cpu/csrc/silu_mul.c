/* The gated MLP's activation for CPU, float32: out = silu(gate) * up in one pass, where
 * gate_up = [gate | up] is the fused gate/up projection's output ([rows, 2 I]) and out is
 * [rows, I] (conveyor.model.models.layers.GatedMLP; its reference is torch's F.silu(gate) * up).
 *
 *     silu(x) = x * sigmoid(x),  sigmoid(x) = 1 / (1 + e^-|x|)  or  e^-|x| / (1 + e^-|x|)
 *
 * e^-|x| <= 1 never overflows; with AVX2 it is vec_math.h's vector e^x (within 1 ulp of
 * expf), so results agree with torch's to fp32 rounding. Rows are split over OpenMP threads
 * only when there is enough work: from 8192 elements, a quarter of RMSNorm's threshold
 * because an element costs an e^x and a division (docs/kernels.md#measured-choices).
 */
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

#define PARALLEL_MIN_ELEMENTS (1 << 13)

static inline float silu_mul(float g, float u)
{
    const float e = expf(-fabsf(g));
    const float sig = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    return g * sig * u;
}

/* Every thread of a running parallel region calls it (decoder_layers.c): the rows split among
 * the team, returning after its barrier. */
void cv_silu_mul_team(const float *gate_up, int64_t in_stride, float *out,
                      int64_t out_stride, int64_t rows, int inter)
{
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *g = gate_up + i * in_stride, *u = g + inter;
        float *o = out + i * out_stride;
        int e = 0;
#ifdef CONVEYOR_AVX2
        const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
        for (; e + 8 <= inter; e += 8) {
            const __m256 x = _mm256_loadu_ps(g + e);
            const __m256 ex = exp_nonpositive(_mm256_or_ps(x, sign)); /* e^-|x| */
            const __m256 num = _mm256_blendv_ps(one, ex, x); /* sign bit set: x < 0 */
            const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, ex));
            _mm256_storeu_ps(o + e, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + e)));
        }
#endif
        for (; e < inter; e++) o[e] = silu_mul(g[e], u[e]);
    }
}

void conveyor_silu_mul_f32(const float *gate_up, int64_t in_stride, float *out,
                           int64_t out_stride, int64_t rows, int inter, int num_threads)
{
    #pragma omp parallel num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    cv_silu_mul_team(gate_up, in_stride, out, out_stride, rows, inter);
}

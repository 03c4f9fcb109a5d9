/* The gated MLP's silu(gate) * up (silu_mul.c) eight at a time on AVX2 + FMA:
 * sigmoid(x) = 1 / (1 + e^-|x|) or e^-|x| / (1 + e^-|x|), e^-|x| by vec_math.h's vector e^x. */
#include "kernels.h"

#ifdef CONVEYOR_AVX2

#include <immintrin.h>

#include "vec_math.h"

int silu_mul_row_f32_avx2(const float *g, const float *u, float *o, int n)
{
    int e = 0;
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; e + 8 <= n; e += 8) {
        const __m256 x = _mm256_loadu_ps(g + e);
        const __m256 ex = exp_nonpositive(_mm256_or_ps(x, sign)); /* e^-|x| */
        const __m256 num = _mm256_blendv_ps(one, ex, x); /* sign bit set: x < 0 */
        const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, ex));
        _mm256_storeu_ps(o + e, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + e)));
    }
    return e;
}

#endif

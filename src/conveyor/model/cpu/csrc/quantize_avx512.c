/* The activations' quantization (quantize.c) on AVX-512: a block of 32 in two zmm registers.
 */
#include "kernels.h"

#ifdef CONVEYOR_AVX512

#include <immintrin.h>

/* quantize_block on a block in two zmm registers, bit for bit: the same largest |x|, the same
 * division and reciprocal, the products rounded to nearest even (cvtps_epi32, as lrintf in the
 * default rounding mode) and the same integer sum; rest (NULL: none) gets x - d q, rounded
 * product then difference, as the scalar loop (no contraction under -std=c11). libm's fmaxf
 * and lrintf are calls per element there: this is most of a decode step's quantization. */
static inline void quantize_block512(const float *v, q8a_block *o, float *rest)
{
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i *)o->q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(o->q + 16), _mm512_cvtepi32_epi8(qb));
    o->d = d;
    o->s = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    if (rest) {
        const __m512 vd = _mm512_set1_ps(d);
        _mm512_storeu_ps(rest, _mm512_sub_ps(a, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(qa))));
        _mm512_storeu_ps(rest + 16, _mm512_sub_ps(b, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(qb))));
    }
}

void quantize_row_q8a_f32_avx512(const float *x, int64_t nb, q8a_block *o, q8a_block *o2)
{
    for (int64_t b = 0; b < nb; b++) {
        float rest[QK];
        quantize_block512(x + b * QK, o + b, o2 ? rest : 0);
        if (o2) quantize_block512(rest, o2 + b, 0);
    }
}

#endif

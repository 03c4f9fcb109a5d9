/* Inline math shared by the CPU kernels: bfloat16 to and from float32, and e^x eight at a
 * time (AVX2 + FMA builds: CONVEYOR_AVX2, kernels.h). */
#ifndef CONVEYOR_VEC_MATH_H
#define CONVEYOR_VEC_MATH_H

#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* A bf16 is the top half of its float32: widening is a shift. */
static inline float bf16_to_f32(uint16_t x)
{
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Rounded to nearest even (a NaN stays a quiet NaN). */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Every 64-byte line of a row into the cache. */
static inline void prefetch_row(const void *row, size_t bytes)
{
    for (size_t c = 0; c < bytes; c += 64) __builtin_prefetch((const char *)row + c);
}

#ifdef CONVEYOR_AVX2
#include <immintrin.h>

/* e^x for x <= 0, eight at a time: x = n ln2 + r with |r| <= ln2 / 2, Cephes' degree-7
 * polynomial for e^r, times 2^n; 0 below the float range. Within 1 ulp of glibc's expf over
 * [-87.3, 0] (checked on a 1e-4 grid). */
static inline __m256 exp_nonpositive(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.3365478515625f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i two_n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(two_n)));
}

#endif
#endif

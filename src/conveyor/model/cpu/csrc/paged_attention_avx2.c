/* The AVX2 task of paged attention (paged_attention.c; D % 8 == 0): the three stages eight
 * lanes wide, paged_attention_avx2_kv.h once per cache element type. */
#include "kernels.h"

#ifdef CONVEYOR_AVX2

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

/* Lane t of the result is the sum of a[t]'s eight lanes. */
static inline __m256 sum_lanes8(const __m256 *a)
{
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* sx[j] = e^(sx[j] - m) for j < len, m the max of sx and sink; returns their sum, plus
 * e^(sink - m) for a sink (-INFINITY: none). */
static float softmax_numerators(float *sx, int len, float sink)
{
    float lanes[8], m = sink, sum = 0.f;
    __m256 vm = _mm256_set1_ps(-INFINITY), vs = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= len; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sx + j));
    _mm256_storeu_ps(lanes, vm);
    for (int t = 0; t < 8; t++) m = lanes[t] > m ? lanes[t] : m;
    for (; j < len; j++) m = sx[j] > m ? sx[j] : m;
    const __m256 mv = _mm256_set1_ps(m);
    for (j = 0; j + 8 <= len; j += 8) {
        const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sx + j), mv));
        _mm256_storeu_ps(sx + j, p);
        vs = _mm256_add_ps(vs, p);
    }
    _mm256_storeu_ps(lanes, vs);
    for (int t = 0; t < 8; t++) sum += lanes[t];
    for (; j < len; j++) {
        sx[j] = expf(sx[j] - m);
        sum += sx[j];
    }
    if (sink != -INFINITY)
        sum += expf(sink - m);
    return sum;
}

/* float32 cache */
#define KV(name) name##_f32_f32
#define KV_FORM(name, form) name##_f32_f32_##form
#define KV_T float
#define LOAD8(p) _mm256_loadu_ps(p)
#include "paged_attention_avx2_kv.h"
#undef KV
#undef KV_FORM
#undef KV_T
#undef LOAD8

/* bfloat16 cache: a bf16 is the top half of its float32, so widening is a shift. */
#define KV(name) name##_bf16_f32
#define KV_FORM(name, form) name##_bf16_f32_##form
#define KV_T uint16_t
#define LOAD8(p)                                                                               \
    _mm256_castsi256_ps(                                                                       \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#include "paged_attention_avx2_kv.h"
#undef KV
#undef KV_FORM
#undef KV_T
#undef LOAD8

#endif

/* Paged attention for CPU, one query row at a time (q, out and the sums float32; the KV cache
 * float32 or bfloat16: conveyor_paged_attention_f32 / _bf16, paged_attention_kv.h once each), read straight from the paged KV
 * cache (no gather into a padded copy, no mask): a decode token, or one token of a prefill
 * chunk, whose keys are its own context [key_begin, key_end).
 *
 * Built and loaded at run time by conveyor.model.cpu.cpu_kernels (cc -O3 -march=native -fopenmp);
 * its torch reference is conveyor.model.attention.torch_attention, which tests compare it against.
 *
 * Layout (conveyor.model.attention): the K (and V) cache of one layer is
 * [num_blocks, block_size, Hkv, D], contiguous; token position p of request b is at block
 * block_tables[b * bt_stride + p / block_size], offset p % block_size. Query head
 * x * G + g (G = Hq / Hkv) reads KV head x, so the G heads of one KV head are G consecutive
 * rows of D floats in q and in out: one task per (row, KV head) reads each K and V row of its
 * context from memory once and, from L1, for all G query heads.
 *
 *     scores[g][j] = scale * <q[g], K[j]>              key_begin <= j < key_end
 *     out[g]       = sum_j softmax_j(scores[g])[j] * V[j]
 *
 * A prefill chunk's token i (position p) has key_end = p + 1: causal attention over the chunk
 * and the request's cached context, whose K/V the backend wrote before calling. The work is
 * the same as a causal SDPA's; the chunk's rows re-read the same K/V rows from cache.
 *
 * With AVX2 + FMA (vec_math.h) and D % 8 == 0 (every model we load) the three stages run
 * eight lanes wide: eight keys' dot products at once in independent registers (summed across
 * lanes once per eight keys), a vector e^x, and the weighted sum of V rows with its
 * accumulators held in registers. Otherwise a portable loop does the same sums.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Rows read ahead: each task's K/V rows are 1 / Hkv of a token's cache line run and hop
 * between blocks, which the hardware prefetchers follow poorly
 * (docs/kernels.md#measured-choices). */
#define PREFETCH_AHEAD 2

static inline void prefetch_row(const void *row, size_t bytes)
{
    for (size_t c = 0; c < bytes; c += 64) __builtin_prefetch((const char *)row + c);
}


#include "vec_math.h"

#ifdef CONVEYOR_AVX2

/* Lane t of the result is the sum of a[t]'s eight lanes. */
static inline __m256 sum_lanes8(const __m256 *a)
{
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* sx[j] = e^(sx[j] - max sx) for j < len; returns their sum. */
static float softmax_numerators(float *sx, int len)
{
    float lanes[8], m = -INFINITY, sum = 0.f;
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
    return sum;
}

#endif

/* float32 cache */
#define KV(name) name##_f32
#define KV_T float
#define LOAD8(p) _mm256_loadu_ps(p)
#define TO_F32(x) (x)
#define STORE_ROW(dst, src, n) memcpy(dst, src, sizeof(float) * (size_t)(n))
#include "paged_attention_kv.h"
#undef KV
#undef KV_T
#undef LOAD8
#undef TO_F32
#undef STORE_ROW

/* bfloat16 cache: half the bytes to read; a bf16 is the top half of its float32, so widening
 * is a shift, and each new value is rounded to nearest even on its way in. */
static inline float bf16_to_f32(uint16_t x)
{
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline void store_row_bf16(uint16_t *dst, const float *src, int64_t n)
{
    for (int64_t e = 0; e < n; e++) dst[e] = f32_to_bf16(src[e]);
}

#define KV(name) name##_bf16
#define KV_T uint16_t
#define LOAD8(p)                                                                               \
    _mm256_castsi256_ps(                                                                       \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define TO_F32(x) bf16_to_f32(x)
#define STORE_ROW(dst, src, n) store_row_bf16(dst, src, n)
#include "paged_attention_kv.h"
#undef KV
#undef KV_T
#undef LOAD8
#undef TO_F32
#undef STORE_ROW

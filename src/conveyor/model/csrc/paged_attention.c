/* Paged attention for CPU, float32, one query row at a time, read straight from the paged KV
 * cache (no gather into a padded copy, no mask): a decode token, or one token of a prefill
 * chunk, whose keys are its own context [key_begin, key_end).
 *
 * Built and loaded at run time by conveyor.model.cpu_kernels (cc -O3 -march=native -fopenmp);
 * its torch reference is conveyor.model.torch_attention, which tests compare it against.
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Rows read ahead: each task's K/V rows are 1 / Hkv of a token's cache line run and hop
 * between blocks, which the hardware prefetchers follow poorly (measured ~5-10 % faster). */
#define PREFETCH_AHEAD 2

static inline void prefetch_row(const float *row, int d)
{
    for (int c = 0; c < d; c += 16) __builtin_prefetch(row + c);
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

/* scores[x * len + j] = scale * <q[x], K[j]>, eight keys at a time (d % 8 == 0). */
static void scores_avx2(const float *qh, const float *k, const int64_t *slot, int64_t stride,
                        int len, int g, int d, float scale, float *scores)
{
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int j0 = 0; j0 < len; j0 += 8) {
        const float *kr[8];
        for (int t = 0; t < 8; t++) kr[t] = k + slot[j0 + t < len ? j0 + t : j0] * stride;
        for (int t = 8; t < 16 && j0 + t < len; t++) prefetch_row(k + slot[j0 + t] * stride, d);
        for (int x = 0; x < g; x++) {
            const float *qx = qh + (int64_t)x * d;
            __m256 a[8];
            for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
            for (int e = 0; e < d; e += 8) {
                const __m256 qv = _mm256_loadu_ps(qx + e);
                for (int t = 0; t < 8; t++)
                    a[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[t] + e), a[t]);
            }
            const __m256 s = _mm256_mul_ps(sum_lanes8(a), vscale);
            float *sx = scores + (int64_t)x * len + j0;
            if (j0 + 8 <= len) {
                _mm256_storeu_ps(sx, s);
            } else { /* the last, partial group: the rows past len were duplicates */
                float tail[8];
                _mm256_storeu_ps(tail, s);
                memcpy(sx, tail, sizeof(float) * (size_t)(len - j0));
            }
        }
    }
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

/* out[0 .. 8 nc) = scale * sum_j p[j] V[j][0 .. 8 nc), the nc accumulators in registers. */
static inline __attribute__((always_inline)) void weighted_rows(
    const float *p, const float *v, const int64_t *slot, int64_t stride, int len, int nc,
    float scale, float *out)
{
    __m256 a[8];
    for (int c = 0; c < nc; c++) a[c] = _mm256_setzero_ps();
    for (int j = 0; j < len; j++) {
        const float *vp = v + slot[j] * stride;
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int c = 0; c < nc; c++) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vp + 8 * c), a[c]);
    }
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int c = 0; c < nc; c++) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(a[c], vscale));
}

/* One task with AVX2 (d % 8 == 0): k, v point at this KV head's lane of the cache. */
static void task_avx2(const float *qh, float *oh, const float *k, const float *v,
                      const int64_t *slot, int64_t stride, int len, int g, int d, float scale,
                      float *scores)
{
    scores_avx2(qh, k, slot, stride, len, g, d, scale, scores);
    for (int x = 0; x < g; x++) {
        float *sx = scores + (int64_t)x * len;
        const float inv = 1.f / softmax_numerators(sx, len);
        float *ox = oh + (int64_t)x * d;
        for (int e0 = 0; e0 < d; e0 += 64) { /* 64 columns = 8 registers at a time */
            if (d - e0 >= 64)
                weighted_rows(sx, v + e0, slot, stride, len, 8, inv, ox + e0);
            else
                weighted_rows(sx, v + e0, slot, stride, len, (d - e0) / 8, inv, ox + e0);
        }
    }
}
#endif

/* One task, portable: the same sums, one key at a time. */
static void task_generic(const float *qh, float *oh, const float *k, const float *v,
                         const int64_t *slot, int64_t stride, int len, int g, int d,
                         float scale, float *scores, float *acc)
{
    for (int x = 0; x < g; x++) {
        const float *qx = qh + (int64_t)x * d;
        float *sx = scores + (int64_t)x * len;
        float m = -INFINITY, sum = 0.f;
        for (int j = 0; j < len; j++) {
            if (j + PREFETCH_AHEAD < len) prefetch_row(k + slot[j + PREFETCH_AHEAD] * stride, d);
            const float *kp = k + slot[j] * stride;
            float s = 0.f;
            #pragma omp simd reduction(+:s)
            for (int e = 0; e < d; e++) s += qx[e] * kp[e];
            sx[j] = s * scale;
            m = sx[j] > m ? sx[j] : m;
        }
        for (int j = 0; j < len; j++) {
            sx[j] = expf(sx[j] - m);
            sum += sx[j];
        }
        memset(acc, 0, sizeof(float) * (size_t)d);
        for (int j = 0; j < len; j++) {
            const float *vp = v + slot[j] * stride;
            const float p = sx[j];
            #pragma omp simd
            for (int e = 0; e < d; e++) acc[e] += p * vp[e];
        }
        float *ox = oh + (int64_t)x * d;
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int e = 0; e < d; e++) ox[e] = acc[e] * inv;
    }
}

/* Copies this step's new K and V rows into the cache: token t's Hkv x D floats go to slot
 * slots[t] (a flat index over num_blocks x block_size). Run before any row attends, so a
 * prefill token sees the keys of its own chunk. */
static int write_new_kv(float *k_cache, float *v_cache, const float *new_k, int64_t k_stride,
                        const float *new_v, int64_t v_stride, const int64_t *slots,
                        int64_t n_new, int64_t num_slots, int64_t stride)
{
    int failed = 0;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < n_new; t++) {
        if (slots[t] < 0 || slots[t] >= num_slots) {
            failed = 4;
            continue;
        }
        memcpy(k_cache + slots[t] * stride, new_k + t * k_stride, sizeof(float) * (size_t)stride);
        memcpy(v_cache + slots[t] * stride, new_v + t * v_stride, sizeof(float) * (size_t)stride);
    }
    return failed;
}

/* Returns 0, or a sum of: 1 when a work buffer could not be allocated, 2 when a row's key
 * range is empty or longer than max_keys (out is then incomplete), 4 when a new token's slot
 * is outside [0, num_slots) (that token is not written).
 *
 * Work is split over OpenMP threads by (row, KV head) tasks. With at least two rows a thread,
 * a thread takes all of a row's KV heads in turn, so it reads each token's whole cache row
 * (Hkv x D contiguous floats) rather than a quarter of it at a 1 KiB stride while the other
 * thread reads the rest: measured 5-25 % faster once the cache is out of L3 (the in-situ
 * case, where each layer's weights stream through between two attention calls). With fewer
 * rows than threads the heads are split, so a lone decode still uses every thread. */
int conveyor_paged_attention_f32(
    const float *q, int64_t q_row_stride,     /* [*, Hq * D]: query row rows[i] */
    float *out, int64_t out_row_stride,       /* written at the same rows */
    float *k_cache, float *v_cache,
    const int32_t *block_tables, int64_t bt_stride,
    const int32_t *key_begin,                 /* [n] first key of row i, or NULL: 0 */
    const int32_t *key_end,                   /* [n] one past its last key (> key_begin) */
    const int64_t *rows, const int64_t *batch, int64_t n, /* row i's block table: batch[i] */
    int hq, int hkv, int d, int block_size, int max_keys, float scale, int num_threads,
    const float *new_k, int64_t new_k_stride, /* [n_new, Hkv * D] rows written first */
    const float *new_v, int64_t new_v_stride,
    const int64_t *slots, int64_t n_new,      /* [n_new] their cache slots */
    int64_t num_slots)                        /* num_blocks x block_size */
{
    const int g = hq / hkv;
    const int64_t stride = (int64_t)hkv * d; /* floats from one token's row to the next */
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        /* Per thread: one task's scores (G rows), token slots and an accumulator row. */
        float *scores = malloc(sizeof(float) * (size_t)g * (size_t)max_keys);
        int64_t *slot = malloc(sizeof(int64_t) * (size_t)max_keys);
        float *acc = malloc(sizeof(float) * (size_t)d);
        const int ok = scores && slot && acc;
        failed |= !ok;
        failed |= write_new_kv(k_cache, v_cache, new_k, new_k_stride, new_v, new_v_stride, slots,
                               n_new, num_slots, stride); /* ends in a barrier */
        const int64_t chunk = n >= 2 * (int64_t)num_threads ? hkv : 1;
        int64_t slots_of = -1; /* the row whose slots `slot` holds */
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t task = 0; task < n * hkv; task++) {
            const int64_t i = task / hkv;
            const int h = (int)(task % hkv);
            if (!ok) continue;
            const int32_t *table = block_tables + batch[i] * bt_stride;
            const int lo = key_begin ? key_begin[i] : 0, len = key_end[i] - lo;
            if (lo < 0 || len < 1 || len > max_keys) {
                failed |= 2;
                continue;
            }
            if (slots_of != i) {
                for (int j = 0; j < len; j++) {
                    const int p = lo + j;
                    slot[j] = (int64_t)table[p / block_size] * block_size + p % block_size;
                }
                slots_of = i;
            }
            const float *qh = q + rows[i] * q_row_stride + (int64_t)h * g * d;
            float *oh = out + rows[i] * out_row_stride + (int64_t)h * g * d;
            const float *k = k_cache + (int64_t)h * d, *v = v_cache + (int64_t)h * d;
#ifdef CONVEYOR_AVX2
            if (d % 8 == 0) {
                task_avx2(qh, oh, k, v, slot, stride, len, g, d, scale, scores);
                continue;
            }
#endif
            task_generic(qh, oh, k, v, slot, stride, len, g, d, scale, scores, acc);
        }
        free(scores);
        free(slot);
        free(acc);
    }
    return failed;
}

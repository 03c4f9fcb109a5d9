/* Paged decode attention for CPU, float32: one query token per request, read straight from
 * the paged KV cache (no gather into a padded copy, no mask).
 *
 * Built and loaded at run time by conveyor.model.cpu_kernels (cc -O3 -march=native -fopenmp);
 * its torch reference is conveyor.model.torch_attention, which tests compare it against.
 *
 * Layout (conveyor.model.attention): the K (and V) cache of one layer is
 * [num_blocks, block_size, Hkv, D], contiguous; token position p of request b is at block
 * block_tables[b * bt_stride + p / block_size], offset p % block_size. Query head
 * x * G + g (G = Hq / Hkv) reads KV head x, so the G heads of one KV head are G consecutive
 * rows of D floats in q and in out: one task per (request, KV head) reads each K and V row
 * of its context once and uses it for all G query heads.
 *
 *     scores[g][j] = scale * <q[g], K[j]>              lo <= j < seq_len
 *     out[g]       = sum_j softmax_j(scores[g])[j] * V[j]
 *
 * lo = 0, or seq_len - window for a sliding window (window > 0) shorter than the context.
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

static inline const float *cache_row(const float *cache, const int32_t *table, int j,
                                     int block_size, int64_t token_stride, int64_t head_off)
{
    const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
    return cache + slot * token_stride + head_off;
}

/* Returns 0, or 1 when a work buffer could not be allocated (out is then incomplete). */
int conveyor_decode_attention_f32(
    const float *q, int64_t q_row_stride,     /* [*, Hq * D]: row rows[i] is request i's query */
    float *out, int64_t out_row_stride,       /* written at the same rows */
    const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t bt_stride,
    const int32_t *seq_lens,                  /* indexed by batch index */
    const int64_t *rows, const int64_t *batch, int64_t n,
    int hq, int hkv, int d, int block_size, int max_seq_len, float scale,
    int window,                               /* sliding window; 0: the whole context */
    int num_threads)
{
    const int g = hq / hkv;
    const int64_t token_stride = (int64_t)hkv * d;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        /* Per thread: the scores of one task, its G accumulators, maxima and sums. */
        float *scores = malloc(sizeof(float) * (size_t)g * (size_t)max_seq_len);
        float *acc = malloc(sizeof(float) * (size_t)g * (size_t)d);
        float *mx = malloc(sizeof(float) * (size_t)g);
        float *inv = malloc(sizeof(float) * (size_t)g);
        const int ok = scores && acc && mx && inv;
        failed |= !ok;
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) {
            for (int h = 0; h < hkv; h++) {
                if (!ok) continue;
                const int64_t b = batch[i];
                const int end = seq_lens[b];
                const int lo = window > 0 && end > window ? end - window : 0;
                const int len = end - lo;             /* keys lo .. end - 1, as 0 .. len - 1 */
                const int32_t *table = block_tables + b * bt_stride;
                const int64_t head_off = (int64_t)h * d;
                const float *qh = q + rows[i] * q_row_stride + (int64_t)h * g * d;
                float *oh = out + rows[i] * out_row_stride + (int64_t)h * g * d;
                for (int x = 0; x < g; x++) mx[x] = -INFINITY;
                for (int j = 0; j < len; j++) {
                    if (j + PREFETCH_AHEAD < len)
                        prefetch_row(cache_row(k_cache, table, lo + j + PREFETCH_AHEAD,
                                               block_size, token_stride, head_off), d);
                    const float *kp = cache_row(k_cache, table, lo + j, block_size,
                                                token_stride, head_off);
                    for (int x = 0; x < g; x++) {
                        const float *qx = qh + (int64_t)x * d;
                        float s = 0.f;
                        #pragma omp simd reduction(+:s)
                        for (int e = 0; e < d; e++) s += qx[e] * kp[e];
                        s *= scale;
                        scores[(int64_t)x * len + j] = s;
                        if (s > mx[x]) mx[x] = s;
                    }
                }
                for (int x = 0; x < g; x++) {
                    float *sx = scores + (int64_t)x * len;
                    float sum = 0.f;
                    for (int j = 0; j < len; j++) {
                        sx[j] = expf(sx[j] - mx[x]);
                        sum += sx[j];
                    }
                    inv[x] = 1.f / sum;
                }
                memset(acc, 0, sizeof(float) * (size_t)g * (size_t)d);
                for (int j = 0; j < len; j++) {
                    if (j + PREFETCH_AHEAD < len)
                        prefetch_row(cache_row(v_cache, table, lo + j + PREFETCH_AHEAD,
                                               block_size, token_stride, head_off), d);
                    const float *vp = cache_row(v_cache, table, lo + j, block_size,
                                                token_stride, head_off);
                    for (int x = 0; x < g; x++) {
                        const float p = scores[(int64_t)x * len + j];
                        float *ax = acc + (int64_t)x * d;
                        #pragma omp simd
                        for (int e = 0; e < d; e++) ax[e] += p * vp[e];
                    }
                }
                for (int x = 0; x < g; x++) {
                    const float *ax = acc + (int64_t)x * d;
                    float *ox = oh + (int64_t)x * d;
                    #pragma omp simd
                    for (int e = 0; e < d; e++) ox[e] = ax[e] * inv[x];
                }
            }
        }
        free(scores);
        free(acc);
        free(mx);
        free(inv);
    }
    return failed;
}

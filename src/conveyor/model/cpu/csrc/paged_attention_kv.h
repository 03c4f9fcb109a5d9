/* The parts of csrc/paged_attention.c that read or write the KV cache, written once for each
 * cache element type: paged_attention.c includes this file once per type after defining
 *
 *   KV(name)         name with the type's suffix (the entry point: conveyor_paged_attention_f32)
 *   KV_T             the cache's element type
 *   LOAD8(p)         (AVX2) eight cache values at p as an __m256 of floats
 *   TO_F32(x)        one cache value as a float
 *   STORE_ROW(dst, src, n)  n floats of src into the cache at dst
 *
 * and undefines them afterwards. q, out and every sum are float32 for either type.
 */
#ifdef CONVEYOR_AVX2
/* scores[x * len + j] = scale * <q[x], K[j]>, eight keys at a time (d % 8 == 0). */
static void KV(scores_avx2)(const float *qh, const KV_T *k, const int64_t *slot, int64_t stride,
                        int len, int g, int d, float scale, float *scores)
{
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int j0 = 0; j0 < len; j0 += 8) {
        const KV_T *kr[8];
        for (int t = 0; t < 8; t++) kr[t] = k + slot[j0 + t < len ? j0 + t : j0] * stride;
        for (int t = 8; t < 16 && j0 + t < len; t++) prefetch_row(k + slot[j0 + t] * stride, d * sizeof(KV_T));
        for (int x = 0; x < g; x++) {
            const float *qx = qh + (int64_t)x * d;
            __m256 a[8];
            for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
            for (int e = 0; e < d; e += 8) {
                const __m256 qv = _mm256_loadu_ps(qx + e);
                for (int t = 0; t < 8; t++)
                    a[t] = _mm256_fmadd_ps(qv, LOAD8(kr[t] + e), a[t]);
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

/* out[0 .. 8 nc) = scale * sum_j p[j] V[j][0 .. 8 nc), the nc accumulators in registers. */
static inline __attribute__((always_inline)) void KV(weighted_rows)(
    const float *p, const KV_T *v, const int64_t *slot, int64_t stride, int len, int nc,
    float scale, float *out)
{
    __m256 a[8];
    for (int c = 0; c < nc; c++) a[c] = _mm256_setzero_ps();
    for (int j = 0; j < len; j++) {
        const KV_T *vp = v + slot[j] * stride;
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int c = 0; c < nc; c++) a[c] = _mm256_fmadd_ps(pj, LOAD8(vp + 8 * c), a[c]);
    }
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int c = 0; c < nc; c++) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(a[c], vscale));
}

/* One task with AVX2 (d % 8 == 0): k, v point at this KV head's lane of the cache. */
static void KV(task_avx2)(const float *qh, float *oh, const KV_T *k, const KV_T *v,
                      const int64_t *slot, int64_t stride, int len, int g, int d, float scale,
                      float *scores)
{
    KV(scores_avx2)(qh, k, slot, stride, len, g, d, scale, scores);
    for (int x = 0; x < g; x++) {
        float *sx = scores + (int64_t)x * len;
        const float inv = 1.f / softmax_numerators(sx, len);
        float *ox = oh + (int64_t)x * d;
        for (int e0 = 0; e0 < d; e0 += 64) { /* 64 columns = 8 registers at a time */
            if (d - e0 >= 64)
                KV(weighted_rows)(sx, v + e0, slot, stride, len, 8, inv, ox + e0);
            else
                KV(weighted_rows)(sx, v + e0, slot, stride, len, (d - e0) / 8, inv, ox + e0);
        }
    }
}
#endif

/* One task, portable: the same sums, one key at a time. */
static void KV(task_generic)(const float *qh, float *oh, const KV_T *k, const KV_T *v,
                         const int64_t *slot, int64_t stride, int len, int g, int d,
                         float scale, float *scores, float *acc)
{
    for (int x = 0; x < g; x++) {
        const float *qx = qh + (int64_t)x * d;
        float *sx = scores + (int64_t)x * len;
        float m = -INFINITY, sum = 0.f;
        for (int j = 0; j < len; j++) {
            if (j + PREFETCH_AHEAD < len) prefetch_row(k + slot[j + PREFETCH_AHEAD] * stride, d * sizeof(KV_T));
            const KV_T *kp = k + slot[j] * stride;
            float s = 0.f;
            #pragma omp simd reduction(+:s)
            for (int e = 0; e < d; e++) s += qx[e] * TO_F32(kp[e]);
            sx[j] = s * scale;
            m = sx[j] > m ? sx[j] : m;
        }
        for (int j = 0; j < len; j++) {
            sx[j] = expf(sx[j] - m);
            sum += sx[j];
        }
        memset(acc, 0, sizeof(float) * (size_t)d);
        for (int j = 0; j < len; j++) {
            const KV_T *vp = v + slot[j] * stride;
            const float p = sx[j];
            #pragma omp simd
            for (int e = 0; e < d; e++) acc[e] += p * TO_F32(vp[e]);
        }
        float *ox = oh + (int64_t)x * d;
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int e = 0; e < d; e++) ox[e] = acc[e] * inv;
    }
}

/* Copies this step's new K and V rows into the cache: token t's Hkv x D values go to slot
 * slots[t] (a flat index over num_blocks x block_size). Run before any row attends, so a
 * prefill token sees the keys of its own chunk. Its loop is schedule(static) over the n_new
 * tokens, so in a team each thread copies the same tokens as in any other static loop over
 * as many (decoder_layers.c rotates the rows that way, with no barrier in between). */
static int KV(write_new_kv)(KV_T *k_cache, KV_T *v_cache, const float *new_k, int64_t k_stride,
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
        STORE_ROW(k_cache + slots[t] * stride, new_k + t * k_stride, stride);
        STORE_ROW(v_cache + slots[t] * stride, new_v + t * v_stride, stride);
    }
    return failed;
}

/* Work is split over OpenMP threads by (row, KV head) tasks. With at least two rows a thread,
 * a thread takes all of a row's KV heads in turn, so it reads each token's whole cache row
 * (Hkv x D contiguous floats) rather than a quarter of it at a 1 KiB stride while the other
 * thread reads the rest: faster once the cache is out of L3 (the in-situ case, where each
 * layer's weights stream through between two attention calls; docs/kernels.md#measured-choices). With fewer
 * rows than threads the heads are split, so a lone decode still uses every thread.
 *
 * This is the kernel's body for a caller already running a parallel region (decoder_layers.c,
 * and the entry point below): every thread of the team calls it with the same arguments and
 * it returns after the team's last barrier; the failure bits of every thread are ORed into
 * *team_failed (shared, zero before), which each thread may read on return. */
void KV(cv_paged_attention_team)(
    const float *q, int64_t q_row_stride, float *out, int64_t out_row_stride, KV_T *k_cache,
    KV_T *v_cache, const int32_t *block_tables, int64_t bt_stride, const int32_t *key_begin,
    const int32_t *key_end, const int64_t *rows, const int64_t *batch, int64_t n, int hq,
    int hkv, int d, int block_size, int max_keys, float scale, const float *new_k,
    int64_t new_k_stride, const float *new_v, int64_t new_v_stride, const int64_t *slots,
    int64_t n_new, int64_t num_slots, int *team_failed)
{
    const int g = hq / hkv;
    const int64_t stride = (int64_t)hkv * d; /* elements from one token's row to the next */
    const int num_threads = omp_get_num_threads();
    int failed = 0;
    {
        /* Per thread: one task's scores (G rows), token slots and an accumulator row. */
        float *scores = malloc(sizeof(float) * (size_t)g * (size_t)max_keys);
        int64_t *slot = malloc(sizeof(int64_t) * (size_t)max_keys);
        float *acc = malloc(sizeof(float) * (size_t)d);
        const int ok = scores && slot && acc;
        failed |= !ok;
        failed |= KV(write_new_kv)(k_cache, v_cache, new_k, new_k_stride, new_v, new_v_stride, slots,
                               n_new, num_slots, stride); /* ends in a barrier */
        const int64_t chunk = n >= 2 * (int64_t)num_threads ? hkv : 1;
        int64_t slots_of = -1; /* the row whose slots `slot` holds */
        #pragma omp for schedule(dynamic, chunk) nowait /* the barrier is after the OR below */
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
            const KV_T *k = k_cache + (int64_t)h * d, *v = v_cache + (int64_t)h * d;
#ifdef CONVEYOR_AVX2
            if (d % 8 == 0) {
                KV(task_avx2)(qh, oh, k, v, slot, stride, len, g, d, scale, scores);
                continue;
            }
#endif
            KV(task_generic)(qh, oh, k, v, slot, stride, len, g, d, scale, scores, acc);
        }
        free(scores);
        free(slot);
        free(acc);
    }
    if (failed) {
        #pragma omp atomic
        *team_failed |= failed;
    }
    #pragma omp barrier /* every task's out and every thread's bits */
}

/* Returns 0, or a sum of: 1 when a work buffer could not be allocated, 2 when a row's key
 * range is empty or longer than max_keys (out is then incomplete), 4 when a new token's slot
 * is outside [0, num_slots) (that token is not written). */
int KV(conveyor_paged_attention)(
    const float *q, int64_t q_row_stride,     /* [*, Hq * D]: query row rows[i] */
    float *out, int64_t out_row_stride,       /* written at the same rows */
    KV_T *k_cache, KV_T *v_cache,
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
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    KV(cv_paged_attention_team)(q, q_row_stride, out, out_row_stride, k_cache, v_cache,
                                block_tables, bt_stride, key_begin, key_end, rows, batch, n, hq,
                                hkv, d, block_size, max_keys, scale, new_k, new_k_stride, new_v,
                                new_v_stride, slots, n_new, num_slots, &failed);
    return failed;
}

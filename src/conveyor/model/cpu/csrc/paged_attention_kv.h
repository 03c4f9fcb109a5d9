/* The parts of csrc/paged_attention.c that read or write the KV cache, written once for each
 * cache element type: paged_attention.c includes this file once per type after defining
 *
 *   KV(name)             name with the type's suffix (the entry point: paged_attention_f32_f32)
 *   KV_FORM(name, form)  the same with a form (paged_attention_f32_f32_team, attend_..._avx2)
 *   KV_T                 the cache's element type
 *   TO_F32(x)            one cache value as a float
 *   STORE_ROW(dst, src, n)  n floats of src into the cache at dst
 *
 * and undefines them afterwards. q, out and every sum are float32 for either type. The AVX2
 * task is paged_attention_avx2.c's.
 */
/* One task, generic: the same sums, one key at a time. */
static void KV_FORM(attend, generic)(ATTEND_ARGS(KV_T), float *acc)
{
    for (int x = 0; x < g; x++) {
        const float *qx = qh + (int64_t)x * d;
        float *sx = scores + (int64_t)x * len;
        float m = sinks ? sinks[x] : -INFINITY, sum = 0.f;
        for (int j = 0; j < len; j++) {
            if (j + PREFETCH_AHEAD < len)
                prefetch_row(k + slot[j + PREFETCH_AHEAD] * stride, d * sizeof(KV_T));
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
        if (sinks)
            sum += expf(sinks[x] - m);
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
 * layer's weights stream through between two attention calls;
 * docs/kernels.md#measured-choices). With fewer rows than threads the heads are split, so a
 * lone decode still uses every thread.
 *
 * This is the kernel's body for a caller already running a parallel region (decoder_layers.c,
 * and the entry point below): every thread of the team calls it with the same arguments and
 * it returns after the team's last barrier; the failure bits of every thread are ORed into
 * *team_failed (shared, zero before), which each thread may read on return. */
void KV_FORM(paged_attention, team)(const attention_rows *r, const attention_args *a,
                                    int *team_failed)
{
    const float *q = a->q, *new_k = a->new_k, *new_v = a->new_v;
    float *out = a->out;
    KV_T *k_cache = (KV_T *)a->k_cache, *v_cache = (KV_T *)a->v_cache;
    const int64_t q_row_stride = a->q_stride, out_row_stride = a->out_stride;
    const int64_t new_k_stride = a->new_k_stride, new_v_stride = a->new_v_stride;
    const int64_t *slots = a->slots;
    const int64_t n_new = a->n_new, num_slots = a->num_slots;
    const int hq = a->hq, hkv = a->hkv, d = a->d, block_size = a->block_size;
    const float scale = a->scale;
    const float *sinks = a->sinks;
    const int32_t *block_tables = r->block_tables, *key_begin = r->key_begin;
    const int32_t *key_end = r->key_end;
    const int64_t *rows = r->rows, *batch = r->batch;
    const int64_t bt_stride = r->bt_stride, n = r->n;
    const int max_keys = r->max_keys;
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
        failed |= KV(write_new_kv)(k_cache, v_cache, new_k, new_k_stride, new_v, new_v_stride,
                                   slots, n_new, num_slots, stride); /* ends in a barrier */
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
            const float *sk = sinks ? sinks + (int64_t)h * g : NULL; /* its G heads' sinks */
#ifdef CONVEYOR_AVX2
            if (d % 8 == 0) {
                KV_FORM(attend, avx2)(qh, oh, k, v, slot, stride, len, g, d, scale, sk, scores);
                continue;
            }
#endif
            KV_FORM(attend, generic)(qh, oh, k, v, slot, stride, len, g, d, scale, sk, scores,
                                     acc);
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
CONVEYOR_EXPORT int KV(paged_attention)(const attention_rows *r, const attention_args *a)
{
    int failed = 0;
    #pragma omp parallel num_threads(a->num_threads)
    KV_FORM(paged_attention, team)(r, a, &failed);
    return failed;
}

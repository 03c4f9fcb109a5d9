/* The AVX2 task of paged_attention.c, written once for each cache element type:
 * paged_attention_avx2.c includes this file once per type after defining
 *
 *   KV(name)             name with the type's suffix (static helpers)
 *   KV_FORM(name, form)  the same with a form (the task: attend_f32_f32_avx2)
 *   KV_T                 the cache's element type
 *   LOAD8(p)             eight cache values at p as an __m256 of floats
 *
 * and undefines them afterwards: eight keys' dot products at once in independent registers
 * (summed across lanes once per eight keys), a vector e^x, and the weighted sum of V rows
 * with its accumulators held in registers; the sums of the generic task (paged_attention_kv.h)
 * in vector lanes.
 */
/* scores[x * len + j] = scale * <q[x], K[j]>, eight keys at a time (d % 8 == 0). */
static void KV(scores)(const float *qh, const KV_T *k, const int64_t *slot, int64_t stride,
                      int len, int g, int d, float scale, float *scores)
{
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int j0 = 0; j0 < len; j0 += 8) {
        const KV_T *kr[8];
        for (int t = 0; t < 8; t++) kr[t] = k + slot[j0 + t < len ? j0 + t : j0] * stride;
        for (int t = 8; t < 16 && j0 + t < len; t++)
            prefetch_row(k + slot[j0 + t] * stride, d * sizeof(KV_T));
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

/* One task (kernels.h's ATTEND_ARGS; d % 8 == 0). */
void KV_FORM(attend, avx2)(ATTEND_ARGS(KV_T))
{
    KV(scores)(qh, k, slot, stride, len, g, d, scale, scores);
    for (int x = 0; x < g; x++) {
        float *sx = scores + (int64_t)x * len;
        const float inv = 1.f / softmax_numerators(sx, len, sinks ? sinks[x] : -INFINITY);
        float *ox = oh + (int64_t)x * d;
        for (int e0 = 0; e0 < d; e0 += 64) { /* 64 columns = 8 registers at a time */
            if (d - e0 >= 64)
                KV(weighted_rows)(sx, v + e0, slot, stride, len, 8, inv, ox + e0);
            else
                KV(weighted_rows)(sx, v + e0, slot, stride, len, (d - e0) / 8, inv, ox + e0);
        }
    }
}

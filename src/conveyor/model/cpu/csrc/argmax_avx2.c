/* Row-wise argmax (argmax.c) on AVX2: eight running maxima with their indices. Lane j sees the
 * elements j, j + 8, j + 16, ... in order and keeps the first index of its maximum (a
 * strictly-greater compare); the lanes' results are then merged by value, the smaller index
 * winning a tie, which is the first index of the row's maximum. */
#include "kernels.h"

#ifdef CONVEYOR_AVX2

#include <immintrin.h>
#include <math.h>

int64_t argmax_row_f32_avx2(const float *x, int64_t n)
{
    __m256 vmax = _mm256_loadu_ps(x);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i cur = vidx;
    const __m256i step = _mm256_set1_epi32(8);
    __m256 nan = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
    int64_t i = 8;
    /* Indices fit int32: a vocabulary is far below 2^31 entries (checked by the caller). */
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        cur = _mm256_add_epi32(cur, step);
        const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_blendv_ps(vmax, v, gt);
        vidx = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
    }
    if (_mm256_movemask_ps(nan)) return -1; /* the caller's scalar loop finds the first */
    float vals[8];
    int32_t idxs[8];
    _mm256_storeu_ps(vals, vmax);
    _mm256_storeu_si256((__m256i *)idxs, vidx);
    float v = vals[0];
    int64_t best = idxs[0];
    for (int j = 1; j < 8; j++) {
        if (vals[j] > v || (vals[j] == v && idxs[j] < best)) {
            v = vals[j];
            best = idxs[j];
        }
    }
    for (; i < n; i++) { /* the tail comes after every index above */
        if (isnan(x[i])) return i;
        if (x[i] > v) {
            v = x[i];
            best = i;
        }
    }
    return best;
}

#endif

/* Row-wise argmax for CPU, float32: out[i] = the first index of the largest value of row i
 * of x ([rows, cols], unit stride along a row), as torch.argmax(x, dim=-1), which the
 * sampler calls on every step's logits (greedy rows, and the exponential race of random
 * ones). A NaN counts as larger than any number and the first NaN wins, as in torch.
 *
 * Why C: torch's CPU argmax is a scalar loop, slower on a large vocabulary than some layers
 * (docs/kernels.md#measured-choices); this loop keeps eight running maxima with their indices
 * in AVX2 registers and is memory-bound.
 *
 * Lane j sees the elements j, j + 8, j + 16, ... in order and keeps the first index of its
 * maximum (a strictly-greater compare); the lanes' results are then merged by value, the
 * smaller index winning a tie, which is the first index of the row's maximum. A row with a
 * NaN is redone by the scalar loop (the compare cannot order NaNs).
 */
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

#define PARALLEL_MIN_ELEMENTS (1 << 15)

static int64_t argmax_scalar(const float *x, int64_t n)
{
    int64_t best = 0;
    float v = x[0];
    if (isnan(v)) return 0;
    for (int64_t i = 1; i < n; i++) {
        if (isnan(x[i])) return i;
        if (x[i] > v) {
            v = x[i];
            best = i;
        }
    }
    return best;
}

static int64_t argmax_row(const float *x, int64_t n)
{
#ifdef CONVEYOR_AVX2
    if (n >= 16) {
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
        if (_mm256_movemask_ps(nan)) return argmax_scalar(x, n);
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
    return argmax_scalar(x, n);
}

void conveyor_argmax_f32(const float *x, int64_t stride, int64_t rows, int64_t cols,
                         int64_t *out, int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) \
        if (rows > 1 && rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, cols);
}

/* Whether row i of x holds a NaN or an infinity: bad[i] = 1 or 0 (the sampler's guard fails
 * such a request alone); returns the number of such rows. One pass over the exponent bits
 * (all ones: inf or NaN), which the compiler vectorises, instead of a sum, an isfinite and a
 * reduction through torch each step. */
int conveyor_nonfinite_rows_f32(const float *x, int64_t stride, int64_t rows, int64_t cols,
                                uint8_t *bad, int num_threads)
{
    int count = 0;
    #pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : count) \
        if (rows > 1 && rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *bits = (const uint32_t *)(x + r * stride);
        uint32_t all_ones = 0;
        for (int64_t i = 0; i < cols; i++)
            all_ones |= (bits[i] & 0x7f800000u) == 0x7f800000u;
        bad[r] = (uint8_t)all_ones;
        count += (int)all_ones;
    }
    return count;
}

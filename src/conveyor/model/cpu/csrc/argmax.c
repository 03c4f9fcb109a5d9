/* Row-wise argmax for CPU, float32: out[i] = the first index of the largest value of row i
 * of x ([rows, cols], unit stride along a row), as torch.argmax(x, dim=-1), which the
 * sampler calls on every step's logits (greedy rows, and the exponential race of random
 * ones). A NaN counts as larger than any number and the first NaN wins, as in torch.
 *
 * Why C: torch's CPU argmax is a scalar loop, slower on a large vocabulary than some layers
 * (docs/kernels.md#measured-choices); this loop keeps eight running maxima with their indices
 * in AVX2 registers (argmax_avx2.c) and is memory-bound. A row in which that loop sees a NaN
 * is redone by the scalar loop (the compare cannot order NaNs).
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

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
        const int64_t best = argmax_row_f32_avx2(x, n);
        if (best >= 0) return best;
    }
#endif
    return argmax_scalar(x, n);
}

CONVEYOR_EXPORT void argmax_f32(const float *x, int64_t stride, int64_t rows, int64_t cols,
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
CONVEYOR_EXPORT int nonfinite_rows_f32(const float *x, int64_t stride, int64_t rows,
                                       int64_t cols, uint8_t *bad, int num_threads)
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

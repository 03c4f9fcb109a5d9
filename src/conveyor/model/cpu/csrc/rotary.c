/* Neox-style rotary embedding for CPU, float32, in place (conveyor.model.models.layers.RopeStep):
 * rotates the q and k heads where the qkv projection wrote them, instead of chunking,
 * multiplying and concatenating into new tensors. Its reference is layers.apply_rotary.
 *
 * cos_sin: [max_position, D] rows of [cos(half) | sin(half)] (RotaryEmbedding.cos_sin_cache);
 * x: token i's heads start at x + i * row_stride, head h at + h * D, each D contiguous floats:
 *     x1, x2 = x[:D/2], x[D/2:]   ->   x1 * cos - x2 * sin,  x2 * cos + x1 * sin
 */
#include <stdint.h>

#include "kernels.h"

#define PARALLEL_MIN_ELEMENTS (1 << 16)

/* Every thread of a running parallel region calls it (decoder_layers.c): the rows split among
 * the team by OpenMP's static schedule, and it returns at once, with no barrier: a thread may
 * go on to its own rows of another static loop over as many rows (the same rows, by
 * OpenMP's rule for static schedules), and the team's next barrier completes them all. */
void rotary_f32_team_nowait(float *x, int64_t row_stride, int64_t rows, int num_heads, int d,
                            const int64_t *positions, const float *cos_sin)
{
    const int half = d / 2;
    #pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < rows; i++) {
        const float *c = cos_sin + positions[i] * d;
        const float *s = c + half;
        for (int h = 0; h < num_heads; h++) {
            float *x1 = x + i * row_stride + (int64_t)h * d;
            float *x2 = x1 + half;
            #pragma omp simd
            for (int j = 0; j < half; j++) {
                const float a = x1[j], b = x2[j];
                x1[j] = a * c[j] - b * s[j];
                x2[j] = b * c[j] + a * s[j];
            }
        }
    }
}

CONVEYOR_EXPORT void rotary_f32(float *x, int64_t row_stride, int64_t rows, int num_heads, int d,
                                const int64_t *positions, const float *cos_sin, int num_threads)
{
    #pragma omp parallel num_threads(num_threads) if (rows * num_heads * d >= PARALLEL_MIN_ELEMENTS)
    rotary_f32_team_nowait(x, row_stride, rows, num_heads, d, positions, cos_sin);
}

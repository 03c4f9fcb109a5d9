/* RMSNorm for CPU, float32, with the residual add fused in (the decoder's calling convention,
 * conveyor.model.models.layers.RMSNorm): one pass over each row instead of an add, a norm and the
 * temporaries between them. Its reference is torch's F.rms_norm, which tests compare it to.
 *
 *     with residual:  residual[i] += x[i];  x[i] = residual[i] * rsqrt(mean(residual[i]^2) + eps) * w
 *     without:        out[i]      = x[i] * rsqrt(mean(x[i]^2) + eps) * w
 *
 * Rows are split over OpenMP threads only when there is enough work (a prefill), so a decode
 * step's few rows pay no fork/join. The *_team functions are the same loops for a caller that
 * already runs a parallel region (decoder_layers.c): every thread of the team calls them,
 * they split the rows among the team and return after its barrier.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#define PARALLEL_MIN_ELEMENTS (1 << 16)

static inline float inv_rms(const float *row, int hidden, float eps)
{
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
    for (int e = 0; e < hidden; e++) ss += row[e] * row[e];
    return 1.f / sqrtf(ss / (float)hidden + eps);
}

void add_rms_norm_f32_f32_team(float *x, int64_t x_stride, float *residual, int64_t r_stride,
                               const float *w, int64_t rows, int hidden, float eps)
{
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        float *xr = x + i * x_stride;
        float *rr = residual + i * r_stride;
        #pragma omp simd
        for (int e = 0; e < hidden; e++) rr[e] += xr[e];
        const float inv = inv_rms(rr, hidden, eps);
        #pragma omp simd
        for (int e = 0; e < hidden; e++) xr[e] = rr[e] * inv * w[e];
    }
}

CONVEYOR_EXPORT void add_rms_norm_f32_f32(float *x, int64_t x_stride, float *residual,
                                          int64_t r_stride, const float *w, int64_t rows,
                                          int hidden, float eps, int num_threads)
{
    #pragma omp parallel num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
    add_rms_norm_f32_f32_team(x, x_stride, residual, r_stride, w, rows, hidden, eps);
}

void rms_norm_f32_f32_team(const float *x, int64_t x_stride, float *out, int64_t out_stride,
                           const float *w, int64_t rows, int hidden, float eps)
{
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *xr = x + i * x_stride;
        float *orow = out + i * out_stride;
        const float inv = inv_rms(xr, hidden, eps);
        #pragma omp simd
        for (int e = 0; e < hidden; e++) orow[e] = xr[e] * inv * w[e];
    }
}

CONVEYOR_EXPORT void rms_norm_f32_f32(const float *x, int64_t x_stride, float *out,
                                      int64_t out_stride, const float *w, int64_t rows,
                                      int hidden, float eps, int num_threads)
{
    #pragma omp parallel num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
    rms_norm_f32_f32_team(x, x_stride, out, out_stride, w, rows, hidden, eps);
}

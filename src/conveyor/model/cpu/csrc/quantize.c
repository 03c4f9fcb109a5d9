/* The activations of a GGUF linear quantized per block of 32 to 8 bits (Q8A: dx = max|x| /
 * 127, qx = round(x / dx), s = dx sum(qx); quant_linear.c's header says why), with a second
 * pass of the rounding error where asked. The AVX-512 variant (quantize_avx512.c) gives the
 * same bits. */
#include <math.h>

#include "kernels.h"

static void quantize_block(const float *v, q8a_block *o)
{
    float amax = 0.f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        const int q = (int)lrintf(v[j] * inv);
        o->q[j] = (int8_t)q;
        sum += q;
    }
    o->d = d;
    o->s = d * (float)sum;
}

void quantize_row_q8a_f32_generic(const float *x, int64_t nb, q8a_block *o, q8a_block *o2)
{
    for (int64_t b = 0; b < nb; b++) {
        const float *v = x + b * QK;
        quantize_block(v, o + b);
        if (o2) {
            float rest[QK];
            for (int j = 0; j < QK; j++) rest[j] = v[j] - o[b].d * o[b].q[j];
            quantize_block(rest, o2 + b);
        }
    }
}

/* The build's variant. */
static inline void quantize_row(const float *x, int64_t nb, q8a_block *o, q8a_block *o2)
{
#ifdef CONVEYOR_AVX512
    quantize_row_q8a_f32_avx512(x, nb, o, o2);
#else
    quantize_row_q8a_f32_generic(x, nb, o, o2);
#endif
}

/* Quantize m rows of x [m, k] (k a multiple of 32) into out: `passes` (1 or 2) sets of m rows
 * of k / 32 Q8A blocks, the second one the first's rounding error. Every thread of the
 * running parallel region's team calls it (decoder_layers.c, or the entry point below): the
 * rows split among them, returning after the team's barrier. */
void quantize_q8a_f32_team(const float *x, int64_t ldx, int64_t m, int64_t k, void *out,
                           int passes)
{
    const int64_t nb = k / QK;
    q8a_block *blocks = (q8a_block *)out;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * ldx, nb, blocks + r * nb, passes > 1 ? blocks + (m + r) * nb : 0);
}

/* The bytes quantize_q8a_f32_own writes for m rows of k, or 0 when that is more than a thread
 * should hold on its stack (OWN_XQ_BYTES): then the team quantizes into one shared buffer. */
#define OWN_XQ_BYTES (32 << 10)
size_t quantize_q8a_own_bytes(int64_t m, int64_t k, int passes)
{
    const size_t bytes = (size_t)(passes > 1 ? 2 : 1) * (size_t)m * (size_t)(k / QK) *
                         sizeof(q8a_block);
    return bytes <= OWN_XQ_BYTES ? bytes : 0;
}

/* quantize_q8a_f32_team's result, every row by the calling thread into out (its own buffer,
 * quantize_q8a_own_bytes long), with no barrier: in a decode step each thread quantizes the
 * row itself rather than wait for one thread to. */
void quantize_q8a_f32_own(const float *x, int64_t ldx, int64_t m, int64_t k, void *out,
                          int passes)
{
    const int64_t nb = k / QK;
    q8a_block *blocks = (q8a_block *)out;
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * ldx, nb, blocks + r * nb, passes > 1 ? blocks + (m + r) * nb : 0);
}

CONVEYOR_EXPORT void quantize_q8a_f32(const float *x, int64_t ldx, int64_t m, int64_t k,
                                      void *out, int passes, int num_threads)
{
    #pragma omp parallel num_threads(num_threads) if (m * (k / QK) >= QUANT_PARALLEL_MIN_BLOCKS)
    quantize_q8a_f32_team(x, ldx, m, k, out, passes);
}

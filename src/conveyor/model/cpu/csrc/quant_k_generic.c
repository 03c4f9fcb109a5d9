/* The K-quants Q4_K, Q5_K and Q6_K (quant_layout.h) in plain C: the dot products of a build
 * without AVX2 (the same integer sums and float operations as quant_k_avx512.c and
 * quant_k_avx2.c), and the rows dequantized to float32 (every build). */
#include <string.h>

#include "kernels.h"
#include "quant_layout.h"
#include "quant_simd.h"

/* Block j (< 8) of row r of an interleaved super-block as integers q[32], the scales of its
 * first and second 16 (equal for Q4_K and Q5_K) and the minimum: w_l = scale q_l - mn. */
static void unpack_block(int qtype, const uint8_t *sb, int r, int j, int8_t *q, float *scale,
                         float *mn)
{
    if (qtype == Q6_K) {
        const int h = j / 4, b = j % 4;
        const uint8_t *ql = sb + Q6_QL + 2 * RUN * h + RUN * (b & 1), *qh = sb + Q6_QH + RUN * h;
        for (int l = 0; l < QK; l++) {
            const uint8_t low = quad_byte(ql, r, l);
            const int lo = b < 2 ? low & 15 : low >> 4;
            q[l] = (int8_t)((lo | ((quad_byte(qh, r, l) >> (2 * b) & 3) << 4)) - 32);
        }
        const int8_t *sc = (const int8_t *)sb + Q6_SC;
        const float d = half_at(sb, r);
        scale[0] = d * sc[QG * (8 * h + 2 * b) + r];
        scale[1] = d * sc[QG * (8 * h + 2 * b + 1) + r];
        *mn = 0.f;
        return;
    }
    const uint8_t *qs = sb + k_qs(qtype) + RUN * (j / 2);
    for (int l = 0; l < QK; l++) {
        const uint8_t byte = quad_byte(qs, r, l);
        int v = j & 1 ? byte >> 4 : byte & 15;
        if (qtype == Q5_K) v |= (quad_byte(sb + K_QH, r, l) >> j & 1) << 4;
        q[l] = (int8_t)v;
    }
    scale[0] = scale[1] = half_at(sb, r) * (float)sb[K_SC + QG * j + r];
    *mn = half_at(sb + 2 * QG, r) * (float)sb[K_MIN + QG * j + r];
}

static float block_dot(const int8_t *q, const float *scale, float mn, const q8a_block *x)
{
    int32_t a = 0, b = 0;
    for (int l = 0; l < QK / 2; l++) a += q[l] * x->q[l];
    for (int l = QK / 2; l < QK; l++) b += q[l] * x->q[l];
    return x->d * (scale[0] * (float)a + scale[1] * (float)b) - mn * x->s;
}

/* Plain C: the same integer sums per half-block, the same float operations in order. */
static inline __attribute__((always_inline)) void
tile_dot(const int qtype, const uint8_t *w, int64_t k, const q8a_block *x, const q8a_block *x2,
         int64_t ldx, int rows, float *out)
{
    const int64_t bytes = k_block_bytes(qtype);
    for (int t = 0; t < rows; t++) {
        const q8a_block *xt = x + t * ldx, *yt = x2 ? x2 + t * ldx : 0;
        for (int r = 0; r < QG; r++) {
            float acc = 0.f;
            for (int64_t i = 0; i < k / QK; i++) {
                int8_t q[QK];
                float scale[2], mn;
                unpack_block(qtype, w + i / 8 * bytes, r, (int)(i % 8), q, scale, &mn);
                acc += block_dot(q, scale, mn, xt + i);
                if (yt) acc += block_dot(q, scale, mn, yt + i);
            }
            out[QG * t + r] = acc;
        }
    }
}

static inline __attribute__((always_inline)) void
row_dequantize(const int qtype, const uint8_t *w, int r, int64_t k, float *out)
{
    const int64_t bytes = k_block_bytes(qtype);
    for (int64_t i = 0; i < k / QK; i++, out += QK) {
        int8_t q[QK];
        float scale[2], mn;
        unpack_block(qtype, w + i / 8 * bytes, r, (int)(i % 8), q, scale, &mn);
        for (int l = 0; l < QK; l++) out[l] = scale[l / 16] * q[l] - mn;
    }
}

#define TILE(TYPE, T, x_, x2_, out_) tile_dot(TYPE, w, k, x_, x2_, ldx, T, out_)
#define DEQUANTIZE row_dequantize
#define QUANT_TYPES K_TYPES
#define DOT_ISA generic
#include "quant_entries.h"

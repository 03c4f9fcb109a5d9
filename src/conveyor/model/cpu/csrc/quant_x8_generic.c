/* Q8_0, Q4_0, Q4_1 and MXFP4 (quant_layout.h) in plain C: the dot products of a build without
 * AVX2 (the same integer sums and float operations as quant_x8_avx512.c and quant_x8_avx2.c),
 * and the rows dequantized to float32 (every build: embedding lookups, prefill GEMMs). */
#include "kernels.h"
#include "quant_layout.h"
#include "quant_simd.h"

static inline int quant(int qtype, const uint8_t *q, int r, int j)
{
    if (qtype == Q8_0) return (int)q[4 * QG * (j / 4) + 4 * r + j % 4] - 128;
    const int jj = j % 16;
    const uint8_t byte = q[4 * QG * (jj / 4) + 4 * r + jj % 4];
    const int nibble = j < 16 ? byte & 15 : byte >> 4;
    return qtype == MXFP4 ? mxfp4_value(nibble) : nibble;
}

/* Row r's block scale: E8M0 (MXFP4) or float16 (the others). */
static inline float scale(int qtype, const uint8_t *p, int r)
{
    return qtype == MXFP4 ? e8m0_half(p[r]) : half_at(p, r);
}

/* Plain C: the same integer sums per block, the same float operations in order. */
static inline __attribute__((always_inline)) void
tile_dot(const int qtype, const uint8_t *w, int64_t k, const q8a_block *x, const q8a_block *x2,
         int64_t ldx, int rows, float *out)
{
    const int64_t bytes = x8_block_bytes(qtype), nb = k / QK;
    const int head = header_bytes(qtype);
    for (int t = 0; t < rows; t++) {
        const q8a_block *xt = x + t * ldx, *yt = x2 ? x2 + t * ldx : 0;
        for (int r = 0; r < QG; r++) {
            float acc = 0.f, extra = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *p = w + b * bytes;
                const float d = scale(qtype, p, r);
                int32_t isum = 0, isum2 = 0;
                for (int j = 0; j < QK; j++) {
                    const int q = quant(qtype, p + head, r, j);
                    isum += q * xt[b].q[j];
                    if (yt) isum2 += q * yt[b].q[j];
                }
                acc += d * xt[b].d * (float)isum;
                float s = xt[b].s;
                if (yt) {
                    acc += d * yt[b].d * (float)isum2;
                    s += yt[b].s;
                }
                if (qtype == Q4_1) {
                    extra += half_at(p + 2 * QG, r) * s;
                } else if (qtype == Q4_0) {
                    extra += d * (-8.f * s);
                }
            }
            out[QG * t + r] = acc + extra;
        }
    }
}

/* Row r of a group: d q (Q8_0, stored + 128; MXFP4, q its doubled E2M1 value and d
 * 2^(e - 128)), d (q - 8) (Q4_0), d q + m (Q4_1). */
static inline __attribute__((always_inline)) void
row_dequantize(const int qtype, const uint8_t *w, int r, int64_t k, float *out)
{
    const int64_t bytes = x8_block_bytes(qtype);
    const int head = header_bytes(qtype);
    for (int64_t b = 0; b < k / QK; b++, out += QK) {
        const uint8_t *p = w + b * bytes, *q = p + head;
        const float d = scale(qtype, p, r);
        const float mn = qtype == Q4_1 ? half_at(p + 2 * QG, r) : 0.f;
        for (int j = 0; j < QK; j++) {
            const int v = quant(qtype, q, r, j);
            if (qtype == Q4_1)
                out[j] = d * (float)v + mn;
            else if (qtype == Q4_0)
                out[j] = d * (float)(v - 8);
            else
                out[j] = d * (float)v;
        }
    }
}

#define TILE(TYPE, T, x_, x2_, out_) tile_dot(TYPE, w, k, x_, x2_, ldx, T, out_)
#define DEQUANTIZE row_dequantize
#define QUANT_TYPES X8_TYPES
#define DOT_ISA generic
#include "quant_entries.h"

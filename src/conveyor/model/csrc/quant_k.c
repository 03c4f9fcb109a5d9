/* GGUF's K-quants kept as the file has them: Q4_K, Q5_K and Q6_K rows against 8-bit
 * activation blocks (quant_linear.c quantizes the activations and runs the rows; this file
 * holds the super-block arithmetic).
 *
 * A super-block holds 256 weights (little-endian, d and dmin float16):
 *
 *     Q4_K  d, dmin, scales[12], qs[128]           144 bytes
 *     Q5_K  d, dmin, scales[12], qh[32], qs[128]   176 bytes
 *     Q6_K  ql[128], qh[64], int8 sc[16], d        210 bytes
 *
 * Q4_K and Q5_K: eight sub-blocks of 32, each with a 6-bit scale s_j and a 6-bit minimum
 * m_j packed into `scales`; w = (d s_j) q - (dmin m_j), q in 0..15 (Q4_K) or 0..31 (Q5_K).
 * Sub-blocks 2c and 2c + 1 share qs[32c .. 32c + 32): the low nibbles are 2c's, the high
 * ones 2c + 1's; Q5_K's fifth bit of weight l of sub-block j is bit j of qh[l].
 *
 * Q6_K: sixteen sub-blocks of 16 with int8 scales; w = (d sc_i) (q - 32), q in 0..63 from a
 * nibble of ql and two bits of qh. In each half of 128 weights (ql + 64 h, qh + 32 h,
 * sc + 8 h), weight 32 b + l (b < 4, l < 32) is
 *
 *     b = 0: ql[l] & 15       | (qh[l] >> 0 & 3) << 4        scale sc[2b + l / 16]
 *     b = 1: ql[l + 32] & 15  | (qh[l] >> 2 & 3) << 4
 *     b = 2: ql[l] >> 4       | (qh[l] >> 4 & 3) << 4
 *     b = 3: ql[l + 32] >> 4  | (qh[l] >> 6 & 3) << 4
 *
 * So each block of 32 weights lines up with one Q8A activation block (dx, qx[32], s =
 * dx sum(qx)), and its contribution is integer dots and per-block float scales:
 *
 *     Q4_K, Q5_K  (d s_j) dx sum(q qx) - (dmin m_j) s
 *     Q6_K        d dx (sc_a (sum_a q qx - 32 sum_a qx) + sc_b (...)), a, b its two halves
 *
 * AVX2: one 32-byte load gives two sub-blocks' quants (masks and shifts), `maddubs` / VNNI's
 * `dpbusd` (quant_blocks.h's dot_u8_s8) the sums; the portable build unpacks each block to
 * integers and sums in C. Both give the same integer sums.
 */
#include "quant_blocks.h"

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[QK_K / 2];
} q4_k_block;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} q5_k_block;

typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t sc[QK_K / 16];
    uint16_t d;
} q6_k_block;

_Static_assert(sizeof(q4_k_block) == 144, "Q4_K layout");
_Static_assert(sizeof(q5_k_block) == 176, "Q5_K layout");
_Static_assert(sizeof(q6_k_block) == 210, "Q6_K layout");

int64_t quant_k_block_bytes(int qtype)
{
    switch (qtype) {
    case Q4_K: return sizeof(q4_k_block);
    case Q5_K: return sizeof(q5_k_block);
    case Q6_K: return sizeof(q6_k_block);
    default: return 0;
    }
}

/* Sub-block j's 6-bit scale and minimum (Q4_K and Q5_K). */
static inline void scale_min(const uint8_t *q, int j, int *sc, int *mn)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Block j (< 8) of one super-block as integers: q[32], the scale of its first and second
 * 16 (equal for Q4_K and Q5_K) and the minimum subtracted (0 for Q6_K): w_l = scale q_l - mn. */
static void unpack_block(int qtype, const uint8_t *sb, int j, int8_t *q, float *scale, float *mn)
{
    if (qtype == Q6_K) {
        const q6_k_block *blk = (const q6_k_block *)sb;
        const int h = j / 4, b = j % 4;
        const uint8_t *ql = blk->ql + 64 * h + (b & 1) * 32, *qh = blk->qh + 32 * h;
        const float d = half_to_float(blk->d);
        for (int l = 0; l < QK; l++) {
            const int lo = b < 2 ? ql[l] & 15 : ql[l] >> 4;
            q[l] = (int8_t)((lo | ((qh[l] >> (2 * b) & 3) << 4)) - 32);
        }
        scale[0] = d * blk->sc[8 * h + 2 * b];
        scale[1] = d * blk->sc[8 * h + 2 * b + 1];
        *mn = 0.f;
        return;
    }
    const int c = j / 2, high = j & 1;
    const uint8_t *scales, *qs, *qh = 0;
    uint16_t d16, dmin16;
    if (qtype == Q4_K) {
        const q4_k_block *blk = (const q4_k_block *)sb;
        scales = blk->scales, qs = blk->qs, d16 = blk->d, dmin16 = blk->dmin;
    } else {
        const q5_k_block *blk = (const q5_k_block *)sb;
        scales = blk->scales, qs = blk->qs, qh = blk->qh, d16 = blk->d, dmin16 = blk->dmin;
    }
    int sc, m;
    scale_min(scales, j, &sc, &m);
    for (int l = 0; l < QK; l++) {
        const uint8_t byte = qs[32 * c + l];
        int v = high ? byte >> 4 : byte & 15;
        if (qh) v |= (qh[l] >> j & 1) << 4;
        q[l] = (int8_t)v;
    }
    scale[0] = scale[1] = half_to_float(d16) * (float)sc;
    *mn = half_to_float(dmin16) * (float)m;
}

void quant_k_row_dequantize(int qtype, const uint8_t *w, int64_t k, float *out)
{
    const int64_t bytes = quant_k_block_bytes(qtype);
    for (int64_t i = 0; i < k / QK; i++, out += QK) {
        int8_t q[QK];
        float scale[2], mn;
        unpack_block(qtype, w + i / 8 * bytes, (int)(i % 8), q, scale, &mn);
        for (int l = 0; l < QK; l++) out[l] = scale[l / 16] * q[l] - mn;
    }
}

#ifdef CONVEYOR_AVX2

/* Sub-blocks 2c and 2c + 1 of a Q4_K / Q5_K super-block as unsigned bytes. */
static inline void unpack_pair(const uint8_t *qs, const uint8_t *qh, int c, __m256i *lo,
                               __m256i *hi)
{
    const __m256i nib = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
    *lo = _mm256_and_si256(raw, nib);
    *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
    if (qh) { /* bit j of qh[l]: masked to one bit per byte before the shift into bit 4 */
        const __m256i bits = _mm256_loadu_si256((const __m256i *)qh);
        const __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * c), one);
        const __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * c + 1), one);
        *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(b0, 4));
        *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(b1, 4));
    }
}

static float row_dot_q45k(int qtype, const uint8_t *w, const q8a_block *x, const q8a_block *x2,
                          int64_t nsb)
{
    const int64_t bytes = quant_k_block_bytes(qtype);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float mins = 0.f;
    for (int64_t i = 0; i < nsb; i++, x += 8, x2 = x2 ? x2 + 8 : 0) {
        const uint8_t *sb = w + i * bytes, *scales, *qs, *qh = 0;
        uint16_t d16, dmin16;
        if (qtype == Q4_K) {
            const q4_k_block *blk = (const q4_k_block *)sb;
            scales = blk->scales, qs = blk->qs, d16 = blk->d, dmin16 = blk->dmin;
        } else {
            const q5_k_block *blk = (const q5_k_block *)sb;
            scales = blk->scales, qs = blk->qs, qh = blk->qh, d16 = blk->d, dmin16 = blk->dmin;
        }
        const float d = half_to_float(d16), dmin = half_to_float(dmin16);
        for (int c = 0; c < 4; c++) {
            __m256i u[2];
            unpack_pair(qs, qh, c, &u[0], &u[1]);
            for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                int sc, m;
                scale_min(scales, j, &sc, &m);
                const float ds = d * (float)sc;
                const __m256i qx = _mm256_loadu_si256((const __m256i *)x[j].q);
                __m256 *acc = h ? &acc1 : &acc0;
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(ds * x[j].d),
                                       _mm256_cvtepi32_ps(dot_u8_s8(u[h], qx)), *acc);
                float s = x[j].s;
                if (x2) {
                    const __m256i qx2 = _mm256_loadu_si256((const __m256i *)x2[j].q);
                    *acc = _mm256_fmadd_ps(_mm256_set1_ps(ds * x2[j].d),
                                           _mm256_cvtepi32_ps(dot_u8_s8(u[h], qx2)), *acc);
                    s += x2[j].s;
                }
                mins += dmin * (float)m * s;
            }
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1)) - mins;
}

/* sum_a q qx - 32 sum_a qx per 4-byte lane (lanes 0-3: the block's first 16, 4-7: the rest). */
static inline __m256i q6_isums(__m256i q, __m256i qx)
{
    return _mm256_sub_epi32(dot_u8_s8(q, qx), dot_u8_s8(_mm256_set1_epi8(32), qx));
}

static float row_dot_q6k(const uint8_t *w, const q8a_block *x, const q8a_block *x2, int64_t nsb)
{
    const __m256i nib = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; i++) {
        const q6_k_block *blk = (const q6_k_block *)(w + i * sizeof(q6_k_block));
        const float d = half_to_float(blk->d);
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * h));
            __m256i q[4];
            q[0] = _mm256_and_si256(ql0, nib);
            q[1] = _mm256_and_si256(ql1, nib);
            q[2] = _mm256_and_si256(_mm256_srli_epi16(ql0, 4), nib);
            q[3] = _mm256_and_si256(_mm256_srli_epi16(ql1, 4), nib);
            for (int b = 0; b < 4; b++) {
                const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * b), three);
                q[b] = _mm256_or_si256(q[b], _mm256_slli_epi16(top, 4));
                const int j = 4 * h + b;
                const int8_t *sc = blk->sc + 8 * h + 2 * b;
                const __m256 scale = _mm256_set_m128(_mm_set1_ps(d * sc[1]), _mm_set1_ps(d * sc[0]));
                __m256 *acc = b & 1 ? &acc1 : &acc0;
                const __m256i qx = _mm256_loadu_si256((const __m256i *)x[8 * i + j].q);
                *acc = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(x[8 * i + j].d)),
                                       _mm256_cvtepi32_ps(q6_isums(q[b], qx)), *acc);
                if (x2) {
                    const __m256i qx2 = _mm256_loadu_si256((const __m256i *)x2[8 * i + j].q);
                    *acc = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(x2[8 * i + j].d)),
                                           _mm256_cvtepi32_ps(q6_isums(q[b], qx2)), *acc);
                }
            }
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

float quant_k_row_dot(int qtype, const uint8_t *w, const q8a_block *x, const q8a_block *x2,
                      int64_t k)
{
    return qtype == Q6_K ? row_dot_q6k(w, x, x2, k / QK_K)
                         : row_dot_q45k(qtype, w, x, x2, k / QK_K);
}

#else

static float block_dot(const int8_t *q, const float *scale, float mn, const q8a_block *x)
{
    int32_t a = 0, b = 0;
    for (int l = 0; l < QK / 2; l++) a += q[l] * x->q[l];
    for (int l = QK / 2; l < QK; l++) b += q[l] * x->q[l];
    return x->d * (scale[0] * (float)a + scale[1] * (float)b) - mn * x->s;
}

float quant_k_row_dot(int qtype, const uint8_t *w, const q8a_block *x, const q8a_block *x2,
                      int64_t k)
{
    const int64_t bytes = quant_k_block_bytes(qtype);
    float acc = 0.f;
    for (int64_t i = 0; i < k / QK; i++) {
        int8_t q[QK];
        float scale[2], mn;
        unpack_block(qtype, w + i / 8 * bytes, (int)(i % 8), q, scale, &mn);
        acc += block_dot(q, scale, mn, x + i);
        if (x2) acc += block_dot(q, scale, mn, x2 + i);
    }
    return acc;
}

#endif

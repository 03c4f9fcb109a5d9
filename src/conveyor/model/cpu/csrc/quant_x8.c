/* Q8_0, Q4_0 and Q4_1 weights interleaved eight rows at a time (quant_linear.py's
 * interleave_x8 writes the layout at load; the bytes are the file's, reordered):
 *
 *     group of rows 8G .. 8G + 7, block b (weights 32 b .. 32 b + 31 of each row):
 *     Q4_0  d[8]              q[4][8][4]    144 bytes
 *     Q4_1  d[8], m[8]        q[4][8][4]    160 bytes
 *     Q8_0  d[8]              q[8][8][4]    272 bytes
 *
 * d and m float16, one per row; q[g][r][i] is the file's quant byte 4 g + i of row r's block:
 * for Q4 the byte holding weights 4 g + i (low nibble) and 16 + 4 g + i (high nibble), for
 * Q8_0 weight 4 g + i. So one 32-byte load holds four consecutive quants of each of the eight
 * rows, and one `dpbusd` (or `maddubs` + `madd`) against four activation quants broadcast to
 * every lane adds them into eight int32 sums, one lane per row: a block's eight dot products
 * without a horizontal sum, and the eight scales convert in one instruction. Per block and
 * row the arithmetic is quant_linear.c's (its header): d dx sum(q qx), minus 8 d s (Q4_0) or
 * plus m s (Q4_1), with the second activation pass added the same way.
 *
 * A weight whose row count is not a multiple of 8 is padded with zero rows (d = 0).
 */
#include "quant_blocks.h"

int64_t quant_x8_block_bytes(int qtype)
{
    switch (qtype) {
    case Q4_0: return 144;
    case Q4_1: return 160;
    case Q8_0: return 272;
    default: return 0;
    }
}

/* Bytes of quants after the scales. */
static inline int header_bytes(int qtype) { return qtype == Q4_1 ? 32 : 16; }

#if defined(CONVEYOR_AVX2) && defined(__F16C__)

#ifdef CONVEYOR_AVX512

/* The block's eight integer sums against one activation block's quants, two quad runs per
 * 512-bit load (quant_blocks.h's quad2), the halves added at the end. */
static inline __attribute__((always_inline)) __m256i block_isums(int qtype, const uint8_t *q, const int8_t *qx)
{
    const __m512i x = quads512(qx);
    __m512i isum = _mm512_setzero_si512();
    if (qtype == Q8_0) {
#ifdef __AVX512VNNI__
        /* qx + 128 (unsigned) times the signed weights, less 128 times the weights' sums:
         * dpbusd does not saturate, so no per-weight sign juggling is needed */
        const __m512i xu = _mm512_xor_si512(x, _mm512_set1_epi8(-128));
        __m512i wsum = _mm512_setzero_si512();
        for (int g = 0; g < 8; g += 2) {
            const __m512i w = _mm512_loadu_si512(q + 32 * g);
            isum = _mm512_dpbusd_epi32(isum, quad2(xu, g), w);
            wsum = _mm512_dpbusd_epi32(wsum, _mm512_set1_epi8(-128), w);
        }
        isum = _mm512_sub_epi32(isum, wsum);
#else
        /* maddubs saturates its int16 pairs: unsigned |w| times qx carrying w's sign */
        for (int g = 0; g < 8; g += 2) {
            const __m512i w = _mm512_loadu_si512(q + 32 * g), xg = quad2(x, g);
            const __mmask64 neg = _mm512_movepi8_mask(w);
            isum = dot_acc512(isum, _mm512_abs_epi8(w),
                              _mm512_mask_sub_epi8(xg, neg, _mm512_setzero_si512(), xg));
        }
#endif
    } else {
        const __m512i nib = _mm512_set1_epi8(15);
        for (int g = 0; g < 4; g += 2) {
            const __m512i v = _mm512_loadu_si512(q + 32 * g);
            isum = dot_acc512(isum, _mm512_and_si512(v, nib), quad2(x, g));
            isum = dot_acc512(isum, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib),
                              quad2(x, 4 + g));
        }
    }
    return halves_sum(isum);
}

#else

/* The block's eight integer sums against one activation block's quants. */
static inline __attribute__((always_inline)) __m256i block_isums(int qtype, const uint8_t *q, const int8_t *qx)
{
    __m256i isum = _mm256_setzero_si256();
    if (qtype == Q8_0) {
        for (int g = 0; g < 8; g++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * g));
            /* unsigned |w| times qx carrying w's sign */
            isum = dot_acc(isum, _mm256_sign_epi8(w, w), _mm256_sign_epi8(quad(qx, g), w));
        }
    } else {
        const __m256i nib = _mm256_set1_epi8(15);
        for (int g = 0; g < 4; g++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * g));
            isum = dot_acc(isum, _mm256_and_si256(v, nib), quad(qx, g));
            isum = dot_acc(isum, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib), quad(qx, 4 + g));
        }
    }
    return isum;
}

#endif

/* Eight rows' dot products (one group) with one activation row of nb blocks; inlined into
 * one copy per type and pass count (constant flags, no branches in the loop). */
static inline __attribute__((always_inline)) void
group_dot_impl(const int qtype, const uint8_t *w, int64_t nb, const q8a_block *x,
               const q8a_block *x2, float *out)
{
    const int64_t bytes = quant_x8_block_bytes(qtype);
    const int head = header_bytes(qtype);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * bytes;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        float s = x[b].s;
        acc0 = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[b].d)),
                               _mm256_cvtepi32_ps(block_isums(qtype, p + head, x[b].q)), acc0);
        if (x2) {
            acc1 = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x2[b].d)),
                                   _mm256_cvtepi32_ps(block_isums(qtype, p + head, x2[b].q)),
                                   acc1);
            s += x2[b].s;
        }
        if (qtype == Q4_1) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
            acc1 = _mm256_fmadd_ps(m, _mm256_set1_ps(s), acc1);
        } else if (qtype == Q4_0) {
            acc1 = _mm256_fmadd_ps(d, _mm256_set1_ps(-8.f * s), acc1);
        }
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc0, acc1));
}

#define GROUP_DOT_FOR(T)                                                                       \
    (x2 ? group_dot_impl(T, w, nb, x, x2, out) : group_dot_impl(T, w, nb, x, 0, out))

static void group_dot(int qtype, const uint8_t *w, int64_t nb, const q8a_block *x,
                      const q8a_block *x2, float *out)
{
    if (qtype == Q8_0)
        GROUP_DOT_FOR(Q8_0);
    else if (qtype == Q4_0)
        GROUP_DOT_FOR(Q4_0);
    else
        GROUP_DOT_FOR(Q4_1);
}

#else

static inline int quant(int qtype, const uint8_t *q, int r, int j)
{
    if (qtype == Q8_0) return (int8_t)q[32 * (j / 4) + 4 * r + j % 4];
    const int jj = j % 16;
    const uint8_t byte = q[32 * (jj / 4) + 4 * r + jj % 4];
    return j < 16 ? byte & 15 : byte >> 4;
}

static void group_dot(int qtype, const uint8_t *w, int64_t nb, const q8a_block *x,
                      const q8a_block *x2, float *out)
{
    const int64_t bytes = quant_x8_block_bytes(qtype);
    const int head = header_bytes(qtype);
    for (int r = 0; r < 8; r++) {
        float acc = 0.f, extra = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *p = w + b * bytes;
            uint16_t h;
            memcpy(&h, p + 2 * r, 2);
            const float d = half_to_float(h);
            int32_t isum = 0, isum2 = 0;
            for (int j = 0; j < QK; j++) {
                const int q = quant(qtype, p + head, r, j);
                isum += q * x[b].q[j];
                if (x2) isum2 += q * x2[b].q[j];
            }
            acc += d * x[b].d * (float)isum;
            float s = x[b].s;
            if (x2) {
                acc += d * x2[b].d * (float)isum2;
                s += x2[b].s;
            }
            if (qtype == Q4_1) {
                memcpy(&h, p + 16 + 2 * r, 2);
                extra += half_to_float(h) * s;
            } else if (qtype == Q4_0) {
                extra += d * (-8.f * s);
            }
        }
        out[r] = acc + extra;
    }
}

#endif

void quant_x8_group_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                        const q8a_block *x2, float *out)
{
    group_dot(qtype, w, k / QK, x, x2, out);
}

void quant_x8_row_dequantize(int qtype, const uint8_t *w, int r, int64_t k, float *out)
{
    const int64_t bytes = quant_x8_block_bytes(qtype);
    const int head = header_bytes(qtype);
    for (int64_t b = 0; b < k / QK; b++, out += QK) {
        const uint8_t *p = w + b * bytes, *q = p + head;
        uint16_t h;
        memcpy(&h, p + 2 * r, 2);
        const float d = half_to_float(h);
        float mn = 0.f;
        if (qtype == Q4_1) {
            memcpy(&h, p + 16 + 2 * r, 2);
            mn = half_to_float(h);
        }
        for (int j = 0; j < QK; j++) {
            if (qtype == Q8_0) {
                out[j] = d * (float)(int8_t)q[32 * (j / 4) + 4 * r + j % 4];
                continue;
            }
            const int jj = j % 16;
            const uint8_t byte = q[32 * (jj / 4) + 4 * r + jj % 4];
            const int v = j < 16 ? byte & 15 : byte >> 4;
            out[j] = qtype == Q4_1 ? d * (float)v + mn : d * (float)(v - 8);
        }
    }
}

/* Q8_0, Q4_0, Q4_1 and MXFP4 (quant_layout.h) against 8-bit activation blocks, AVX2: one
 * activation row at a time, each half of the group (eight rows) in a 256-bit register, the
 * integer dot by maddubs + madd (Q8_0's signed weights through the sign trick
 * |w| x sign(qx, w); MXFP4's nibbles become their values + 12 by one byte shuffle, its sums
 * started from -12 sum(qx)), or 256-bit dpbusd where the build has AVX-512 VNNI. The same
 * sums as quant_x8_avx512.c.
 */
#include "kernels.h"

#ifdef CONVEYOR_QUANT_AVX2

#include "quant_layout.h"
#include "quant_simd.h"

/* The block's eight integer sums (half hf of the group) against one activation block, from
 * `seed` (MXFP4's -12 sum(qx); 0 for the others). */
static inline __attribute__((always_inline)) __m256i
block_isums(int qtype, const uint8_t *q, const int8_t *qx, int32_t seed)
{
    __m256i isum = _mm256_set1_epi32(seed);
    if (qtype == Q8_0) {
        for (int g = 0; g < 8; g++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 4 * QG * g));
            const __m256i w = _mm256_xor_si256(v, _mm256_set1_epi8(-128)); /* signed again */
            /* unsigned |w| times qx carrying w's sign */
            isum = dot_acc(isum, _mm256_sign_epi8(w, w), _mm256_sign_epi8(quad(qx, g), w));
        }
    } else {
        const __m256i nib = _mm256_set1_epi8(15);
        const __m256i table = _mm256_broadcastsi128_si256(mxfp4_table());
        for (int g = 0; g < 4; g++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 4 * QG * g));
            __m256i lo = _mm256_and_si256(v, nib);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            if (qtype == MXFP4) {
                lo = _mm256_shuffle_epi8(table, lo);
                hi = _mm256_shuffle_epi8(table, hi);
            }
            isum = dot_acc(isum, lo, quad(qx, g));
            isum = dot_acc(isum, hi, quad(qx, 4 + g));
        }
    }
    return isum;
}

/* Eight rows' dot products (half hf of a group) with one activation row of nb blocks (sx,
 * sx2: the xsum of its blocks and of their second pass, read for MXFP4); inlined into one
 * copy per type and pass count. */
static inline __attribute__((always_inline)) void
half_dot(const int qtype, const uint8_t *w, int hf, int64_t nb, const q8a_block *x,
         const q8a_block *x2, const int32_t *sx, const int32_t *sx2, float *out)
{
    const int64_t bytes = x8_block_bytes(qtype);
    const int head = header_bytes(qtype);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * bytes, *q = p + head + 32 * hf;
        const __m256 d = qtype == MXFP4 ? e8m0_halves8(p + 8 * hf) : halves8(p + 16 * hf);
        float s = x[b].s;
        const int32_t seed = qtype == MXFP4 ? sx[2 * b] : 0;
        acc0 = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[b].d)),
                               _mm256_cvtepi32_ps(block_isums(qtype, q, x[b].q, seed)), acc0);
        if (x2) {
            const int32_t seed2 = qtype == MXFP4 ? sx2[2 * b] : 0;
            acc1 = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x2[b].d)),
                                   _mm256_cvtepi32_ps(block_isums(qtype, q, x2[b].q, seed2)), acc1);
            s += x2[b].s;
        }
        if (qtype == Q4_1) {
            acc1 = _mm256_fmadd_ps(halves8(p + 2 * QG + 16 * hf), _mm256_set1_ps(s), acc1);
        } else if (qtype == Q4_0) {
            acc1 = _mm256_fmadd_ps(d, _mm256_set1_ps(-8.f * s), acc1);
        }
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc0, acc1));
}

/* One activation row (x2: its second pass, or NULL), each half of the group in turn; a copy
 * for each pass count. The entry point's xsum is laid out as its x (both passes), so a
 * block's sums are at xsum + 2 (block - x). */
#define XSUM_AT(x_) (xsum ? xsum + 2 * ((x_) - x) : 0)
#define TILE(TYPE, T, x_, x2_, out_)                                                           \
    for (int hf = 0; hf < 2; hf++)                                                             \
        if (x2_)                                                                               \
            half_dot(TYPE, w, hf, k / QK, x_, x2_, XSUM_AT(x_), XSUM_AT(x2_), (out_) + 8 * hf); \
        else                                                                                   \
            half_dot(TYPE, w, hf, k / QK, x_, 0, XSUM_AT(x_), 0, (out_) + 8 * hf)
#define QUANT_TYPES X8_TYPES
#define DOT_ISA avx2
#include "quant_entries.h"
#undef XSUM_AT

#endif

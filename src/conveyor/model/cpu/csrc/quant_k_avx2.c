/* The K-quants Q4_K, Q5_K and Q6_K (quant_layout.h; the arithmetic in quant_k_avx512.c's
 * header) against 8-bit activation blocks, AVX2: one activation row at a time, eight weight
 * rows (half a group) per register. The same sums as quant_k_avx512.c.
 */
#include "kernels.h"

#ifdef CONVEYOR_QUANT_AVX2

#include "quant_layout.h"
#include "quant_simd.h"

/* Eight rows (the half `hf` of a group: bytes 32 hf .. 32 hf + 31 of each 64-byte quad row,
 * scales 8 hf ..) against one activation row (x2: the second pass, or NULL), nsb
 * super-blocks; inlined into one copy per type and pass count. */
static inline __attribute__((always_inline)) void
half_dot_q45k(const int qtype, const uint8_t *w, int hf, int64_t nsb, const q8a_block *x,
              const q8a_block *x2, float *out)
{
    const int64_t bytes = k_block_bytes(qtype);
    const __m256i nib = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; i++, x += 8, x2 = x2 ? x2 + 8 : 0) {
        const uint8_t *sb = w + i * bytes, *qs = sb + k_qs(qtype) + 32 * hf;
        const __m256 d = halves8(sb + 16 * hf), dmin = halves8(sb + 2 * QG + 16 * hf);
        for (int c = 0; c < 4; c++) {
            const int j0 = 2 * c, j1 = 2 * c + 1;
            __m256i a = _mm256_setzero_si256(), b = a, a2 = a, b2 = a;
            for (int g = 0; g < 8; g++) {
                const __m256i v =
                    _mm256_loadu_si256((const __m256i *)(qs + RUN * c + 4 * QG * g));
                __m256i lo = _mm256_and_si256(v, nib);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                if (qtype == Q5_K) {
                    const __m256i h = _mm256_loadu_si256(
                        (const __m256i *)(sb + K_QH + 4 * QG * g + 32 * hf));
                    const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(h, j0), one);
                    const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(h, j1), one);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(h0, 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(h1, 4));
                }
                a = dot_acc(a, lo, quad(x[j0].q, g));
                b = dot_acc(b, hi, quad(x[j1].q, g));
                if (x2) {
                    a2 = dot_acc(a2, lo, quad(x2[j0].q, g));
                    b2 = dot_acc(b2, hi, quad(x2[j1].q, g));
                }
            }
            const __m256 s0 = _mm256_mul_ps(d, bytes8(sb + K_SC + QG * j0 + 8 * hf, 0));
            const __m256 s1 = _mm256_mul_ps(d, bytes8(sb + K_SC + QG * j1 + 8 * hf, 0));
            const __m256 m0 = _mm256_mul_ps(dmin, bytes8(sb + K_MIN + QG * j0 + 8 * hf, 0));
            const __m256 m1 = _mm256_mul_ps(dmin, bytes8(sb + K_MIN + QG * j1 + 8 * hf, 0));
            acc = _mm256_fmadd_ps(_mm256_mul_ps(s0, _mm256_set1_ps(x[j0].d)),
                                  _mm256_cvtepi32_ps(a), acc);
            acc = _mm256_fmadd_ps(_mm256_mul_ps(s1, _mm256_set1_ps(x[j1].d)),
                                  _mm256_cvtepi32_ps(b), acc);
            float t0 = x[j0].s, t1 = x[j1].s;
            if (x2) {
                acc = _mm256_fmadd_ps(_mm256_mul_ps(s0, _mm256_set1_ps(x2[j0].d)),
                                      _mm256_cvtepi32_ps(a2), acc);
                acc = _mm256_fmadd_ps(_mm256_mul_ps(s1, _mm256_set1_ps(x2[j1].d)),
                                      _mm256_cvtepi32_ps(b2), acc);
                t0 += x2[j0].s, t1 += x2[j1].s;
            }
            mins = _mm256_fmadd_ps(m0, _mm256_set1_ps(t0), mins);
            mins = _mm256_fmadd_ps(m1, _mm256_set1_ps(t1), mins);
        }
    }
    _mm256_storeu_ps(out, _mm256_sub_ps(acc, mins));
}

/* 32 times the sum of 16 signed activation quants. */
static inline int32_t offset16(const int8_t *q)
{
    const __m128i v = _mm_xor_si128(_mm_loadu_si128((const __m128i *)q), _mm_set1_epi8(-128));
    const __m128i sad = _mm_sad_epu8(v, _mm_setzero_si128());
    return 32 * (_mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4) - 16 * 128);
}

/* One activation block's contribution for block b (< 4) of half h, eight rows (half hf of
 * the group). */
static inline __attribute__((always_inline)) __m256
q6_block(const uint8_t *sb, int hf, int h, int b, const q8a_block *x, __m256 d)
{
    const __m256i nib = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    const uint8_t *ql = sb + Q6_QL + 2 * RUN * h + RUN * (b & 1) + 32 * hf;
    const uint8_t *qh = sb + Q6_QH + RUN * h + 32 * hf;
    __m256i lo = _mm256_setzero_si256(), hi = lo;
    for (int g = 0; g < 8; g++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(ql + 4 * QG * g));
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(qh + 4 * QG * g));
        const __m256i low = b < 2 ? _mm256_and_si256(v, nib)
                                  : _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        const __m256i top = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * b), three);
        const __m256i q = _mm256_or_si256(low, _mm256_slli_epi16(top, 4));
        if (g < 4)
            lo = dot_acc(lo, q, quad(x->q, g));
        else
            hi = dot_acc(hi, q, quad(x->q, g));
    }
    lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(offset16(x->q)));
    hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(offset16(x->q + 16)));
    const int8_t *sc = (const int8_t *)sb + Q6_SC + QG * (8 * h + 2 * b) + 8 * hf;
    const __m256 dx = _mm256_mul_ps(d, _mm256_set1_ps(x->d));
    const __m256 sum = _mm256_fmadd_ps(bytes8((const uint8_t *)sc, 1), _mm256_cvtepi32_ps(lo),
                                       _mm256_mul_ps(bytes8((const uint8_t *)sc + QG, 1),
                                                     _mm256_cvtepi32_ps(hi)));
    return _mm256_mul_ps(dx, sum);
}

static inline __attribute__((always_inline)) void
half_dot_q6k(const uint8_t *w, int hf, int64_t nsb, const q8a_block *x, const q8a_block *x2,
             float *out)
{
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; i++) {
        const uint8_t *sb = w + i * k_block_bytes(Q6_K);
        const __m256 d = halves8(sb + 16 * hf);
        for (int j = 0; j < 8; j++) {
            acc0 = _mm256_add_ps(acc0, q6_block(sb, hf, j / 4, j % 4, x + 8 * i + j, d));
            if (x2)
                acc1 = _mm256_add_ps(acc1, q6_block(sb, hf, j / 4, j % 4, x2 + 8 * i + j, d));
        }
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc0, acc1));
}

/* One activation row (x2: its second pass, or NULL), each half of the group in turn; a copy
 * for each pass count. */
#define TILE(TYPE, T, x_, x2_, out_)                                                           \
    for (int hf = 0; hf < 2; hf++)                                                             \
        if (TYPE == Q6_K)                                                                      \
            (x2_) ? half_dot_q6k(w, hf, k / QK_K, x_, x2_, (out_) + 8 * hf)                    \
                  : half_dot_q6k(w, hf, k / QK_K, x_, 0, (out_) + 8 * hf);                     \
        else                                                                                   \
            (x2_) ? half_dot_q45k(TYPE, w, hf, k / QK_K, x_, x2_, (out_) + 8 * hf)             \
                  : half_dot_q45k(TYPE, w, hf, k / QK_K, x_, 0, (out_) + 8 * hf)
#define QUANT_TYPES K_TYPES
#define DOT_ISA avx2
#include "quant_entries.h"

#endif

/* GGUF's K-quants Q4_K, Q5_K and Q6_K against 8-bit activation blocks, on weights
 * interleaved eight rows at a time at load (quant_linear.py's interleave_x8), as quant_x8.c
 * does for the 32-weight types.
 *
 * In the file a super-block holds 256 weights of one row (little-endian, d and dmin
 * float16):
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
 * nibble of ql and two bits of qh. In each half h of 128 weights (ql + 64 h, qh + 32 h,
 * sc + 8 h), weight 32 b + l (b < 4, l < 32) is
 *
 *     b = 0: ql[l] & 15       | (qh[l] >> 0 & 3) << 4        scale sc[2b + l / 16]
 *     b = 1: ql[l + 32] & 15  | (qh[l] >> 2 & 3) << 4
 *     b = 2: ql[l] >> 4       | (qh[l] >> 4 & 3) << 4
 *     b = 3: ql[l + 32] >> 4  | (qh[l] >> 6 & 3) << 4
 *
 * Interleaved, per group of eight rows and super-block ("quads": a 32-byte run of each row
 * stored as q[8][8 rows][4], four bytes of each row side by side, as in quant_x8.c):
 *
 *     Q4_K  d[8], dmin[8], sc[8][8], m[8][8], qs: 4 runs as quads     1184 bytes
 *     Q5_K  d[8], dmin[8], sc[8][8], m[8][8], qh quads, qs quads      1440 bytes
 *     Q6_K  d[8], int8 sc[16][8], ql: 4 runs as quads, qh: 2 runs     1680 bytes
 *
 * with the 6-bit scales and minimums decoded to bytes ([sub-block][row]; 2-3% more than the
 * file for Q4_K and Q5_K, Q6_K the same size). Each block of 32 weights lines up with one
 * Q8A activation block (dx, qx[32], s = dx sum(qx)), and its contribution is
 *
 *     Q4_K, Q5_K  (d s_j) dx sum(q qx) - (dmin m_j) s
 *     Q6_K        d dx (sc_a (sum_a q qx - 32 sum_a qx) + sc_b (...)), a, b its two halves
 *
 * eight rows at once: an integer sum per lane, the lanes' scales converted together.
 */
#include "quant_blocks.h"

int64_t quant_k_block_bytes(int qtype)
{
    switch (qtype) {
    case Q4_K: return 1184;
    case Q5_K: return 1440;
    case Q6_K: return 1680;
    default: return 0;
    }
}

/* Offsets in an interleaved super-block of eight rows. */
enum { K_SC = 32, K_MIN = 96, K_QH = 160 };             /* Q4_K / Q5_K (qs at 160, or 416) */
enum { Q6_SC = 16, Q6_QL = 144, Q6_QH = 144 + 1024 };  /* Q6_K */

static inline int k_qs(int qtype) { return qtype == Q5_K ? K_QH + 256 : K_QH; }

/* Byte j (< 32) of row r's 32-byte run stored as quads at p. */
static inline uint8_t quad_byte(const uint8_t *p, int r, int j)
{
    return p[32 * (j / 4) + 4 * r + j % 4];
}

static inline float half_at(const uint8_t *p, int r)
{
    uint16_t h;
    memcpy(&h, p + 2 * r, 2);
    return half_to_float(h);
}

/* Block j (< 8) of row r of an interleaved super-block as integers q[32], the scales of its
 * first and second 16 (equal for Q4_K and Q5_K) and the minimum: w_l = scale q_l - mn. */
static void unpack_block(int qtype, const uint8_t *sb, int r, int j, int8_t *q, float *scale,
                         float *mn)
{
    if (qtype == Q6_K) {
        const int h = j / 4, b = j % 4;
        const uint8_t *ql = sb + Q6_QL + 512 * h + 256 * (b & 1), *qh = sb + Q6_QH + 256 * h;
        for (int l = 0; l < QK; l++) {
            const uint8_t low = quad_byte(ql, r, l);
            const int lo = b < 2 ? low & 15 : low >> 4;
            q[l] = (int8_t)((lo | ((quad_byte(qh, r, l) >> (2 * b) & 3) << 4)) - 32);
        }
        const int8_t *sc = (const int8_t *)sb + Q6_SC;
        const float d = half_at(sb, r);
        scale[0] = d * sc[8 * (8 * h + 2 * b) + r];
        scale[1] = d * sc[8 * (8 * h + 2 * b + 1) + r];
        *mn = 0.f;
        return;
    }
    const uint8_t *qs = sb + k_qs(qtype) + 256 * (j / 2);
    for (int l = 0; l < QK; l++) {
        const uint8_t byte = quad_byte(qs, r, l);
        int v = j & 1 ? byte >> 4 : byte & 15;
        if (qtype == Q5_K) v |= (quad_byte(sb + K_QH, r, l) >> j & 1) << 4;
        q[l] = (int8_t)v;
    }
    scale[0] = scale[1] = half_at(sb, r) * (float)sb[K_SC + 8 * j + r];
    *mn = half_at(sb + 16, r) * (float)sb[K_MIN + 8 * j + r];
}

void quant_k_row_dequantize(int qtype, const uint8_t *w, int r, int64_t k, float *out)
{
    const int64_t bytes = quant_k_block_bytes(qtype);
    for (int64_t i = 0; i < k / QK; i++, out += QK) {
        int8_t q[QK];
        float scale[2], mn;
        unpack_block(qtype, w + i / 8 * bytes, r, (int)(i % 8), q, scale, &mn);
        for (int l = 0; l < QK; l++) out[l] = scale[l / 16] * q[l] - mn;
    }
}

#if defined(CONVEYOR_AVX2) && defined(__F16C__)

static inline __m256 halves8(const uint8_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline __m256 bytes8(const uint8_t *p, int is_signed)
{
    const __m128i raw = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
}

/* Eight rows against one activation row (x2: the second pass, or NULL), nsb super-blocks;
 * inlined into one copy per type and pass count (constant flags, no branches in the loop). */
static inline __attribute__((always_inline)) void
group_dot_q45k_impl(const int qtype, const uint8_t *w, int64_t nsb, const q8a_block *x,
                    const q8a_block *x2, float *out)
{
    const int64_t bytes = quant_k_block_bytes(qtype);
    const __m256i nib = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; i++, x += 8, x2 = x2 ? x2 + 8 : 0) {
        const uint8_t *sb = w + i * bytes, *qs = sb + k_qs(qtype);
        const __m256 d = halves8(sb), dmin = halves8(sb + 16);
        for (int c = 0; c < 4; c++) {
            const int j0 = 2 * c, j1 = 2 * c + 1;
#ifdef CONVEYOR_AVX512
            /* two quad runs per 512-bit load (quant_blocks.h's quad2) */
            const __m512i nib5 = _mm512_set1_epi8(15), one5 = _mm512_set1_epi8(1);
            const __m512i xa = quads512(x[j0].q), xb = quads512(x[j1].q);
            const __m512i xa2 = x2 ? quads512(x2[j0].q) : xa, xb2 = x2 ? quads512(x2[j1].q) : xb;
            __m512i a5 = _mm512_setzero_si512(), b5 = a5, a25 = a5, b25 = a5;
            for (int g = 0; g < 8; g += 2) {
                const __m512i v = _mm512_loadu_si512(qs + 256 * c + 32 * g);
                __m512i lo = _mm512_and_si512(v, nib5);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib5);
                if (qtype == Q5_K) {
                    const __m512i h = _mm512_loadu_si512(sb + K_QH + 32 * g);
                    const __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(h, j0), one5);
                    const __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(h, j1), one5);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(h0, 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(h1, 4));
                }
                a5 = dot_acc512(a5, lo, quad2(xa, g));
                b5 = dot_acc512(b5, hi, quad2(xb, g));
                if (x2) {
                    a25 = dot_acc512(a25, lo, quad2(xa2, g));
                    b25 = dot_acc512(b25, hi, quad2(xb2, g));
                }
            }
            const __m256i a = halves_sum(a5), b = halves_sum(b5);
            const __m256i a2 = halves_sum(a25), b2 = halves_sum(b25);
            (void)nib, (void)one;
#else
            __m256i a = _mm256_setzero_si256(), b = a, a2 = a, b2 = a;
            for (int g = 0; g < 8; g++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 256 * c + 32 * g));
                __m256i lo = _mm256_and_si256(v, nib);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                if (qtype == Q5_K) {
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(sb + K_QH + 32 * g));
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
#endif
            const __m256 s0 = _mm256_mul_ps(d, bytes8(sb + K_SC + 8 * j0, 0));
            const __m256 s1 = _mm256_mul_ps(d, bytes8(sb + K_SC + 8 * j1, 0));
            const __m256 m0 = _mm256_mul_ps(dmin, bytes8(sb + K_MIN + 8 * j0, 0));
            const __m256 m1 = _mm256_mul_ps(dmin, bytes8(sb + K_MIN + 8 * j1, 0));
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

static void group_dot_q45k(int qtype, const uint8_t *w, int64_t nsb, const q8a_block *x,
                           const q8a_block *x2, float *out)
{
    if (qtype == Q5_K) {
        if (x2)
            group_dot_q45k_impl(Q5_K, w, nsb, x, x2, out);
        else
            group_dot_q45k_impl(Q5_K, w, nsb, x, 0, out);
    } else if (x2) {
        group_dot_q45k_impl(Q4_K, w, nsb, x, x2, out);
    } else {
        group_dot_q45k_impl(Q4_K, w, nsb, x, 0, out);
    }
}

/* 32 times the sum of 16 signed activation quants. */
static inline int32_t offset16(const int8_t *q)
{
    const __m128i v = _mm_xor_si128(_mm_loadu_si128((const __m128i *)q), _mm_set1_epi8(-128));
    const __m128i sad = _mm_sad_epu8(v, _mm_setzero_si128());
    return 32 * (_mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4) - 16 * 128);
}

/* One activation block's contribution for block b (< 4) of half h, eight rows. 256-bit
 * even where the build has AVX-512: two runs per 512-bit load measured slower here for a
 * single activation row (and no faster for sixteen). */
static inline __attribute__((always_inline)) __m256 q6_block(const uint8_t *sb, int h, int b, const q8a_block *x, __m256 d)
{
    const __m256i nib = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    const uint8_t *ql = sb + Q6_QL + 512 * h + 256 * (b & 1), *qh = sb + Q6_QH + 256 * h;
    __m256i lo = _mm256_setzero_si256(), hi = lo;
    for (int g = 0; g < 8; g++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(ql + 32 * g));
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(qh + 32 * g));
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
    const int8_t *sc = (const int8_t *)sb + Q6_SC + 8 * (8 * h + 2 * b);
    const __m256 dx = _mm256_mul_ps(d, _mm256_set1_ps(x->d));
    const __m256 sum = _mm256_fmadd_ps(bytes8((const uint8_t *)sc, 1), _mm256_cvtepi32_ps(lo),
                                       _mm256_mul_ps(bytes8((const uint8_t *)sc + 8, 1),
                                                     _mm256_cvtepi32_ps(hi)));
    return _mm256_mul_ps(dx, sum);
}

static inline __attribute__((always_inline)) void
group_dot_q6k_impl(const uint8_t *w, int64_t nsb, const q8a_block *x, const q8a_block *x2,
                   float *out)
{
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; i++) {
        const uint8_t *sb = w + i * quant_k_block_bytes(Q6_K);
        const __m256 d = halves8(sb);
        for (int j = 0; j < 8; j++) {
            acc0 = _mm256_add_ps(acc0, q6_block(sb, j / 4, j % 4, x + 8 * i + j, d));
            if (x2) acc1 = _mm256_add_ps(acc1, q6_block(sb, j / 4, j % 4, x2 + 8 * i + j, d));
        }
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc0, acc1));
}

static void group_dot_q6k(const uint8_t *w, int64_t nsb, const q8a_block *x,
                          const q8a_block *x2, float *out)
{
    if (x2)
        group_dot_q6k_impl(w, nsb, x, x2, out);
    else
        group_dot_q6k_impl(w, nsb, x, 0, out);
}

void quant_k_group_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                       const q8a_block *x2, float *out)
{
    if (qtype == Q6_K)
        group_dot_q6k(w, k / QK_K, x, x2, out);
    else
        group_dot_q45k(qtype, w, k / QK_K, x, x2, out);
}

#else

static float block_dot(const int8_t *q, const float *scale, float mn, const q8a_block *x)
{
    int32_t a = 0, b = 0;
    for (int l = 0; l < QK / 2; l++) a += q[l] * x->q[l];
    for (int l = QK / 2; l < QK; l++) b += q[l] * x->q[l];
    return x->d * (scale[0] * (float)a + scale[1] * (float)b) - mn * x->s;
}

void quant_k_group_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                       const q8a_block *x2, float *out)
{
    const int64_t bytes = quant_k_block_bytes(qtype);
    for (int r = 0; r < 8; r++) {
        float acc = 0.f;
        for (int64_t i = 0; i < k / QK; i++) {
            int8_t q[QK];
            float scale[2], mn;
            unpack_block(qtype, w + i / 8 * bytes, r, (int)(i % 8), q, scale, &mn);
            acc += block_dot(q, scale, mn, x + i);
            if (x2) acc += block_dot(q, scale, mn, x2 + i);
        }
        out[r] = acc;
    }
}

#endif

/* GGUF's K-quants Q4_K, Q5_K and Q6_K against 8-bit activation blocks, on weights
 * interleaved QG = 16 rows at a time at load (quant_linear.py's interleave_groups), as
 * quant_x8.c does for the 32-weight types.
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
 * Interleaved, per group of sixteen rows and super-block ("quads": a 32-byte run of each row
 * stored as q[8][16 rows][4], four bytes of each row side by side, as in quant_x8.c):
 *
 *     Q4_K  d[16], dmin[16], sc[8][16], m[8][16], qs: 4 runs as quads     2368 bytes
 *     Q5_K  d[16], dmin[16], sc[8][16], m[8][16], qh quads, qs quads      2880 bytes
 *     Q6_K  d[16], int8 sc[16][16], ql: 4 runs as quads, qh: 2 runs       3360 bytes
 *
 * with the 6-bit scales and minimums decoded to bytes ([sub-block][row]; 2-3% more than the
 * file for Q4_K and Q5_K, Q6_K the same size). Each block of 32 weights lines up with one
 * Q8A activation block (dx, qx[32], s = dx sum(qx)), and its contribution is
 *
 *     Q4_K, Q5_K  (d s_j) dx sum(q qx) - (dmin m_j) s
 *     Q6_K        d dx (sc_a (sum_a q qx - 32 sum_a qx) + sc_b (...)), a, b its two halves
 *
 * sixteen rows at once: an integer sum per lane, the lanes' scales converted together.
 *
 * Several activation rows at once (AVX-512): a tile of up to QT rows of x (and both passes)
 * takes each 64-byte load of quants, unpacked once (nibbles split, Q5_K / Q6_K's high bits
 * merged), into every row's sums (one dpbusd each, the row's four quants broadcast from
 * memory); the sub-block scales are decoded once per tile. Per activation row the integer
 * sums and the float operations, in order, are those of one row alone, so a row's result
 * does not depend on the tile it ran in. The AVX2 path takes one row at a time, eight weight
 * rows (half a group) per register; the portable path is plain C.
 */
#include "quant_blocks.h"



/* Bytes per interleaved super-block (static inline: a shared object's exported function may
 * be interposed, so -fPIC code would call it, not fold the constant, inside the kernels). */
static inline int64_t k_block_bytes(int qtype)
{
    switch (qtype) {
    case Q4_K: return 2368;
    case Q5_K: return 2880;
    case Q6_K: return 3360;
    default: return 0;
    }
}

int64_t quant_k_block_bytes(int qtype) { return k_block_bytes(qtype); }

/* Offsets in an interleaved super-block of sixteen rows; a quad run is 8 x 64 bytes. */
enum { K_SC = 64, K_MIN = 192, K_QH = 320 };            /* Q4_K / Q5_K (qs at 320, or 832) */
enum { Q6_SC = 32, Q6_QL = 288, Q6_QH = 288 + 2048 };  /* Q6_K */
enum { RUN = 8 * 4 * QG };                              /* bytes of a 32-byte run as quads */

static inline int k_qs(int qtype) { return qtype == Q5_K ? K_QH + RUN : K_QH; }

/* Byte j (< 32) of row r's 32-byte run stored as quads at p. */
static inline uint8_t quad_byte(const uint8_t *p, int r, int j)
{
    return p[4 * QG * (j / 4) + 4 * r + j % 4];
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

void quant_k_row_dequantize(int qtype, const uint8_t *w, int r, int64_t k, float *out)
{
    const int64_t bytes = k_block_bytes(qtype);
    for (int64_t i = 0; i < k / QK; i++, out += QK) {
        int8_t q[QK];
        float scale[2], mn;
        unpack_block(qtype, w + i / 8 * bytes, r, (int)(i % 8), q, scale, &mn);
        for (int l = 0; l < QK; l++) out[l] = scale[l / 16] * q[l] - mn;
    }
}

#if defined(CONVEYOR_AVX512) && defined(__F16C__)

/* `T` activation rows (ldx blocks apart; x2 their second pass, or NULL) against a group's
 * sixteen rows, nsb super-blocks; inlined into one copy per type, tile height and pass count
 * (constant flags: no branches in the loop). */
static inline __attribute__((always_inline)) void
tile_q45k(const int qtype, const int T, const uint8_t *w, int64_t nsb, const q8a_block *x,
          const q8a_block *x2, int64_t ldx, float *out)
{
    const int64_t bytes = k_block_bytes(qtype);
    const __m512i nib = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    __m512 acc[QT], mins[QT];
    for (int t = 0; t < T; t++) acc[t] = mins[t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nsb; i++) {
        const uint8_t *sb = w + i * bytes, *qs = sb + k_qs(qtype);
        const __m512 d = halves16(sb), dmin = halves16(sb + 2 * QG);
        for (int c = 0; c < 4; c++) {
            const int j0 = 8 * (int)i + 2 * c, j1 = j0 + 1; /* activation blocks */
            /* Q5_K: reload qh each pass over it (the compiler would otherwise keep all eight
             * quads of it in registers across c, which a tile needs for its sums) */
            if (qtype == Q5_K) __asm__ volatile("" ::: "memory");
            /* a lone row's sums split in two by quad parity (more dependency chains in
             * flight; integer adds, so the same sums) */
            __m512i a[QT + 1], b[QT + 1], a2[QT + 1], b2[QT + 1];
            for (int t = 0; t < T + (T == 1); t++)
                a[t] = b[t] = a2[t] = b2[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                const __m512i v = _mm512_loadu_si512(qs + RUN * c + 4 * QG * g);
                prefetch_slot(sb, bytes, 8 * c + g, 32);
                __m512i lo = _mm512_and_si512(v, nib);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                if (qtype == Q5_K) {
                    const __m512i h = _mm512_loadu_si512(sb + K_QH + 4 * QG * g);
                    const __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(h, 2 * c), one);
                    const __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(h, 2 * c + 1), one);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(h0, 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(h1, 4));
                }
                for (int t = 0; t < T; t++) {
                    const q8a_block *xt = x + t * ldx;
                    const int u = T == 1 ? g & 1 : t;
                    a[u] = dot_acc512(a[u], lo, bcast4(xt[j0].q + 4 * g));
                    b[u] = dot_acc512(b[u], hi, bcast4(xt[j1].q + 4 * g));
                    if (x2) {
                        const q8a_block *yt = x2 + t * ldx;
                        a2[u] = dot_acc512(a2[u], lo, bcast4(yt[j0].q + 4 * g));
                        b2[u] = dot_acc512(b2[u], hi, bcast4(yt[j1].q + 4 * g));
                    }
                }
            }
            if (T == 1) {
                a[0] = _mm512_add_epi32(a[0], a[1]), b[0] = _mm512_add_epi32(b[0], b[1]);
                a2[0] = _mm512_add_epi32(a2[0], a2[1]), b2[0] = _mm512_add_epi32(b2[0], b2[1]);
            }
            const __m512 s0 = _mm512_mul_ps(d, bytes16(sb + K_SC + QG * 2 * c, 0));
            const __m512 s1 = _mm512_mul_ps(d, bytes16(sb + K_SC + QG * (2 * c + 1), 0));
            const __m512 m0 = _mm512_mul_ps(dmin, bytes16(sb + K_MIN + QG * 2 * c, 0));
            const __m512 m1 = _mm512_mul_ps(dmin, bytes16(sb + K_MIN + QG * (2 * c + 1), 0));
            for (int t = 0; t < T; t++) {
                const q8a_block *xt = x + t * ldx;
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(s0, _mm512_set1_ps(xt[j0].d)),
                                         _mm512_cvtepi32_ps(a[t]), acc[t]);
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(s1, _mm512_set1_ps(xt[j1].d)),
                                         _mm512_cvtepi32_ps(b[t]), acc[t]);
                float t0 = xt[j0].s, t1 = xt[j1].s;
                if (x2) {
                    const q8a_block *yt = x2 + t * ldx;
                    acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(s0, _mm512_set1_ps(yt[j0].d)),
                                             _mm512_cvtepi32_ps(a2[t]), acc[t]);
                    acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(s1, _mm512_set1_ps(yt[j1].d)),
                                             _mm512_cvtepi32_ps(b2[t]), acc[t]);
                    t0 += yt[j0].s, t1 += yt[j1].s;
                }
                mins[t] = _mm512_fmadd_ps(m0, _mm512_set1_ps(t0), mins[t]);
                mins[t] = _mm512_fmadd_ps(m1, _mm512_set1_ps(t1), mins[t]);
            }
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + QG * t, _mm512_sub_ps(acc[t], mins[t]));
}

/* Q6_K: quads g0 .. g0 + 3 (one half of 16) of sub-block b's quants at ql / qh (the low
 * nibble for b < 2, the high one else, and bits 2b, 2b + 1 of qh) into each tile row's sums
 * s (and s2, the second pass) against activation block blk. */
static inline __attribute__((always_inline)) void
q6_quads(const int T, const uint8_t *sb, const uint8_t *ql, const uint8_t *qh, int b, int g0,
         const q8a_block *x, const q8a_block *x2, int64_t ldx, int64_t blk, __m512i *s,
         __m512i *s2)
{
    const __m512i nib = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
#pragma GCC unroll 8
    for (int g = g0; g < g0 + 4; g++) {
        const __m512i v = _mm512_loadu_si512(ql + 4 * QG * g);
        const __m512i bits = _mm512_loadu_si512(qh + 4 * QG * g);
        prefetch_slot(sb, k_block_bytes(Q6_K), 8 * (int)(blk % 8) + g, 64);
        const __m512i low = b < 2 ? v : _mm512_srli_epi16(v, 4);
        /* bits 2b, 2b + 1 of each byte to bits 4, 5 */
        const __m512i hb = b < 2 ? _mm512_slli_epi16(bits, 4 - 2 * b)
                                 : _mm512_srli_epi16(bits, 2 * b - 4);
        /* (low & 15) | (hb & 0x30) */
        const __m512i q = _mm512_ternarylogic_epi32(_mm512_and_si512(low, nib), hb, top, 0xF8);
        for (int t = 0; t < T; t++) {
            s[t] = dot_acc512(s[t], q, bcast4(x[t * ldx + blk].q + 4 * g));
            if (x2) s2[t] = dot_acc512(s2[t], q, bcast4(x2[t * ldx + blk].q + 4 * g));
        }
    }
}

/* Q6_K: sub-block j (= 4 h + b) of each super-block from ql run (h, b & 1) and qh run h;
 * each half of 16 starts from the activations' -32 sum(qx) (xsum) and takes its own scale. */
static inline __attribute__((always_inline)) void
tile_q6k(const int T, const uint8_t *w, int64_t nsb, const q8a_block *x, const q8a_block *x2,
         int64_t ldx, const int32_t *xsum, float *out)
{
    const int64_t bytes = k_block_bytes(Q6_K);
    const int32_t *xsum2 = xsum + 2 * (x2 - x); /* pass 2's rows follow pass 1's */
    __m512 acc[QT], acc2[QT];
    for (int t = 0; t < T; t++) acc[t] = acc2[t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nsb; i++) {
        const uint8_t *sb = w + i * bytes;
        const __m512 d = halves16(sb);
        for (int j = 0; j < 8; j++) {
            const int h = j / 4, b = j % 4;
            const int64_t blk = 8 * i + j; /* the activation block */
            const uint8_t *ql = sb + Q6_QL + 2 * RUN * h + RUN * (b & 1);
            const uint8_t *qh = sb + Q6_QH + RUN * h;
            __m512 f[QT], f2[QT]; /* the first 16's sums, converted */
            __m512i s[QT], s2[QT];
            for (int t = 0; t < T; t++) {
                s[t] = _mm512_set1_epi32(xsum[2 * (t * ldx + blk)]);
                s2[t] = x2 ? _mm512_set1_epi32(xsum2[2 * (t * ldx + blk)]) : s[t];
            }
            q6_quads(T, sb, ql, qh, b, 0, x, x2, ldx, blk, s, s2);
            for (int t = 0; t < T; t++) {
                f[t] = _mm512_cvtepi32_ps(s[t]);
                f2[t] = _mm512_cvtepi32_ps(s2[t]);
                s[t] = _mm512_set1_epi32(xsum[2 * (t * ldx + blk) + 1]);
                s2[t] = x2 ? _mm512_set1_epi32(xsum2[2 * (t * ldx + blk) + 1]) : s[t];
            }
            q6_quads(T, sb, ql, qh, b, 4, x, x2, ldx, blk, s, s2);
            const int8_t *sc = (const int8_t *)sb + Q6_SC + QG * (8 * h + 2 * b);
            const __m512 sa = bytes16((const uint8_t *)sc, 1);
            const __m512 sbb = bytes16((const uint8_t *)sc + QG, 1);
            for (int t = 0; t < T; t++) {
                const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(x[t * ldx + blk].d));
                const __m512 sum = _mm512_fmadd_ps(sa, f[t],
                                                   _mm512_mul_ps(sbb, _mm512_cvtepi32_ps(s[t])));
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(dx, sum));
                if (x2) {
                    const __m512 dx2 = _mm512_mul_ps(d, _mm512_set1_ps(x2[t * ldx + blk].d));
                    const __m512 sum2 = _mm512_fmadd_ps(
                        sa, f2[t], _mm512_mul_ps(sbb, _mm512_cvtepi32_ps(s2[t])));
                    acc2[t] = _mm512_add_ps(acc2[t], _mm512_mul_ps(dx2, sum2));
                }
            }
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + QG * t, _mm512_add_ps(acc[t], acc2[t]));
}

/* One copy per type, tile height (1 .. QT) and pass count. */
#define TILE_Q45K(Q, T)                                                                        \
    (x2 ? tile_q45k(Q, T, w, nsb, x, x2, ldx, out) : tile_q45k(Q, T, w, nsb, x, 0, ldx, out))
#define TILE_Q6K(T)                                                                            \
    (x2 ? tile_q6k(T, w, nsb, x, x2, ldx, xsum, out) : tile_q6k(T, w, nsb, x, 0, ldx, xsum, out))
#define BY_ROWS(CALL)                                                                          \
    switch (rows) {                                                                            \
    case 1: CALL(1); break;                                                                    \
    case 2: CALL(2); break;                                                                    \
    case 3: CALL(3); break;                                                                    \
    default: CALL(4); break;                                                                   \
    }

static void tile_q4k(const uint8_t *w, int64_t nsb, const q8a_block *x, const q8a_block *x2,
                     int64_t ldx, int rows, float *out)
{
#define Q4K(T) TILE_Q45K(Q4_K, T)
    BY_ROWS(Q4K)
#undef Q4K
}

static void tile_q5k(const uint8_t *w, int64_t nsb, const q8a_block *x, const q8a_block *x2,
                     int64_t ldx, int rows, float *out)
{
#define Q5K(T) TILE_Q45K(Q5_K, T)
    BY_ROWS(Q5K)
#undef Q5K
}

static void tile_q6(const uint8_t *w, int64_t nsb, const q8a_block *x, const q8a_block *x2,
                    int64_t ldx, int rows, const int32_t *xsum, float *out)
{
    BY_ROWS(TILE_Q6K)
}

_Static_assert(QT == 4, "BY_ROWS instantiates tiles of 1 .. 4 rows");

void quant_k_tile_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                      const q8a_block *x2, int64_t ldx, int rows, const int32_t *xsum,
                      float *out)
{
    if (qtype == Q6_K)
        tile_q6(w, k / QK_K, x, x2, ldx, rows, xsum, out);
    else if (qtype == Q5_K)
        tile_q5k(w, k / QK_K, x, x2, ldx, rows, out);
    else
        tile_q4k(w, k / QK_K, x, x2, ldx, rows, out);
}

#elif defined(CONVEYOR_AVX2) && defined(__F16C__)

static inline __m256 halves8(const uint8_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline __m256 bytes8(const uint8_t *p, int is_signed)
{
    const __m128i raw = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
}

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

static void row_dot(int qtype, const uint8_t *w, int hf, int64_t nsb, const q8a_block *x,
                    const q8a_block *x2, float *out)
{
    if (qtype == Q6_K) {
        if (x2)
            half_dot_q6k(w, hf, nsb, x, x2, out);
        else
            half_dot_q6k(w, hf, nsb, x, 0, out);
    } else if (qtype == Q5_K) {
        if (x2)
            half_dot_q45k(Q5_K, w, hf, nsb, x, x2, out);
        else
            half_dot_q45k(Q5_K, w, hf, nsb, x, 0, out);
    } else if (x2) {
        half_dot_q45k(Q4_K, w, hf, nsb, x, x2, out);
    } else {
        half_dot_q45k(Q4_K, w, hf, nsb, x, 0, out);
    }
}

/* One activation row at a time, each half of the group in turn. */
void quant_k_tile_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                      const q8a_block *x2, int64_t ldx, int rows, const int32_t *xsum,
                      float *out)
{
    (void)xsum;
    for (int t = 0; t < rows; t++)
        for (int hf = 0; hf < 2; hf++)
            row_dot(qtype, w, hf, k / QK_K, x + t * ldx, x2 ? x2 + t * ldx : 0,
                    out + QG * t + 8 * hf);
}

#else

static float block_dot(const int8_t *q, const float *scale, float mn, const q8a_block *x)
{
    int32_t a = 0, b = 0;
    for (int l = 0; l < QK / 2; l++) a += q[l] * x->q[l];
    for (int l = QK / 2; l < QK; l++) b += q[l] * x->q[l];
    return x->d * (scale[0] * (float)a + scale[1] * (float)b) - mn * x->s;
}

void quant_k_tile_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                      const q8a_block *x2, int64_t ldx, int rows, const int32_t *xsum,
                      float *out)
{
    const int64_t bytes = k_block_bytes(qtype);
    (void)xsum;
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

#endif

#ifdef CONVEYOR_QUANT_PANELS

void quant_k_group_panel(int qtype, const uint8_t *w, int64_t k, uint16_t *panel)
{
    const int64_t bytes = k_block_bytes(qtype);
    const __m512i nib = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    const __m512i top = _mm512_set1_epi8(0x30);
    const __m512 zero = _mm512_setzero_ps();
    /* weight kk of a super-block starts pair kk / 2 of its panel: panel + kk * QG */
    for (int64_t i = 0; i < k / QK_K; i++, panel += QK_K * QG) {
        const uint8_t *sb = w + i * bytes;
        const __m512 d = halves16(sb);
        if (qtype == Q6_K) {
            for (int j = 0; j < 8; j++) { /* sub-block j = 4 h + b, as tile_q6k reads it */
                const int h = j / 4, b = j % 4;
                const uint8_t *ql = sb + Q6_QL + 2 * RUN * h + RUN * (b & 1);
                const uint8_t *qh = sb + Q6_QH + RUN * h;
                const uint8_t *sc = sb + Q6_SC + QG * (8 * h + 2 * b);
                const __m512 s0 = _mm512_mul_ps(d, bytes16(sc, 1));
                const __m512 s1 = _mm512_mul_ps(d, bytes16(sc + QG, 1));
                for (int g = 0; g < 8; g++) {
                    const __m512i v = _mm512_loadu_si512(ql + 4 * QG * g);
                    const __m512i bits = _mm512_loadu_si512(qh + 4 * QG * g);
                    const __m512i low = b < 2 ? v : _mm512_srli_epi16(v, 4);
                    const __m512i hb = b < 2 ? _mm512_slli_epi16(bits, 4 - 2 * b)
                                             : _mm512_srli_epi16(bits, 2 * b - 4);
                    const __m512i q = _mm512_ternarylogic_epi32(_mm512_and_si512(low, nib), hb,
                                                                top, 0xF8);
                    panel_columns4(q, 32, g < 4 ? s0 : s1, zero, panel + (32 * j + 4 * g) * QG);
                }
            }
            continue;
        }
        const __m512 dmin = halves16(sb + 2 * QG);
        const uint8_t *qs = sb + k_qs(qtype);
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
            const int j0 = 2 * c, j1 = 2 * c + 1;
            const __m512 s0 = _mm512_mul_ps(d, bytes16(sb + K_SC + QG * j0, 0));
            const __m512 s1 = _mm512_mul_ps(d, bytes16(sb + K_SC + QG * j1, 0));
            const __m512 m0 = _mm512_mul_ps(dmin, bytes16(sb + K_MIN + QG * j0, 0));
            const __m512 m1 = _mm512_mul_ps(dmin, bytes16(sb + K_MIN + QG * j1, 0));
            for (int g = 0; g < 8; g++) {
                const __m512i v = _mm512_loadu_si512(qs + RUN * c + 4 * QG * g);
                __m512i lo = _mm512_and_si512(v, nib);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                if (qtype == Q5_K) {
                    const __m512i hb = _mm512_loadu_si512(sb + K_QH + 4 * QG * g);
                    const __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(hb, j0), one);
                    const __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(hb, j1), one);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(h0, 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(h1, 4));
                }
                panel_columns4(lo, 0, s0, m0, panel + (32 * j0 + 4 * g) * QG);
                panel_columns4(hi, 0, s1, m1, panel + (32 * j1 + 4 * g) * QG);
            }
        }
    }
}

#endif

/* Q8_0, Q4_0 and Q4_1 weights interleaved QG = 16 rows at a time (quant_linear.py's
 * interleave_groups writes the layout at load; the bytes are the file's, reordered):
 *
 *     group of rows 16G .. 16G + 15, block b (weights 32 b .. 32 b + 31 of each row):
 *     Q4_0  d[16]               q[4][16][4]    288 bytes
 *     Q4_1  d[16], m[16]        q[4][16][4]    320 bytes
 *     Q8_0  d[16]               q[8][16][4]    544 bytes
 *
 * d and m float16, one per row; q[g][r][i] is the file's quant byte 4 g + i of row r's block:
 * for Q4 the byte holding weights 4 g + i (low nibble) and 16 + 4 g + i (high nibble), for
 * Q8_0 weight 4 g + i plus 128 (stored unsigned: dpbusd multiplies unsigned weights by
 * signed activations without saturating, and the block's 128 sum(qx) comes off). So one
 * 64-byte load holds four consecutive quants of each of the sixteen rows, and one `dpbusd`
 * (or `maddubs` + `madd`) against four activation quants broadcast to every lane adds them
 * into sixteen int32 sums, one lane per row: a block's sixteen dot products without a
 * horizontal sum, and the sixteen scales convert in one instruction. Per block and row the
 * arithmetic is quant_linear.c's (its header): d dx sum(q qx), minus 8 d s (Q4_0) or plus
 * m s (Q4_1), with the second activation pass added the same way.
 *
 * AVX-512: a tile of up to QT activation rows (both passes) takes each load of quants,
 * unpacked once, into every row's sums; per row the integer sums and the float operations,
 * in order, are those of the row alone (its result does not depend on the tile). AVX2: one
 * activation row at a time, each half of the group (eight rows) in a 256-bit register.
 * Portable: plain C.
 *
 * A weight whose row count is not a multiple of 16 is padded with zero rows (d = 0).
 */
#include "quant_blocks.h"

/* Bytes per interleaved block (static inline, as quant_k.c's k_block_bytes: constant in
 * the kernels even in -fPIC code). */
static inline int64_t x16_block_bytes(int qtype)
{
    switch (qtype) {
    case Q4_0: return 288;
    case Q4_1: return 320;
    case Q8_0: return 544;
    default: return 0;
    }
}

int64_t quant_x8_block_bytes(int qtype) { return x16_block_bytes(qtype); }

/* Bytes of scales before the quants. */
static inline int header_bytes(int qtype) { return qtype == Q4_1 ? 4 * QG : 2 * QG; }

#if defined(CONVEYOR_AVX512) && defined(__F16C__)

/* `T` activation rows (ldx blocks apart; x2 their second pass, or NULL) against a group's
 * sixteen rows, nb blocks; inlined into one copy per type, tile height and pass count. */
static inline __attribute__((always_inline)) void
tile_x16(const int qtype, const int T, const uint8_t *w, int64_t nb, const q8a_block *x,
         const q8a_block *x2, int64_t ldx, const int32_t *xsum, float *out)
{
    const int64_t bytes = x16_block_bytes(qtype);
    const int head = header_bytes(qtype);
    const __m512i nib = _mm512_set1_epi8(15);
    const int32_t *xsum2 = xsum ? xsum + 2 * (x2 - x) : 0;
    (void)xsum2; /* read by the dpbusd path only */
    __m512 acc0[QT], acc1[QT];
    for (int t = 0; t < T; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * bytes, *q = p + head;
        __m512i s[QT], s2[QT];
        for (int t = 0; t < T; t++) {
#ifdef __AVX512VNNI__
            if (qtype == Q8_0) { /* from -128 sum(qx): the weights' + 128 */
                s[t] = _mm512_set1_epi32(xsum[2 * (t * ldx + b)]);
                if (x2) s2[t] = _mm512_set1_epi32(xsum2[2 * (t * ldx + b)]);
                continue;
            }
#endif
            s[t] = s2[t] = _mm512_setzero_si512();
        }
        if (qtype == Q8_0) {
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                const __m512i v = _mm512_loadu_si512(q + 4 * QG * g);
                prefetch_slot(p, bytes, g, 8);
#ifdef __AVX512VNNI__
                for (int t = 0; t < T; t++) {
                    s[t] = _mm512_dpbusd_epi32(s[t], v, bcast4(x[t * ldx + b].q + 4 * g));
                    if (x2)
                        s2[t] = _mm512_dpbusd_epi32(s2[t], v, bcast4(x2[t * ldx + b].q + 4 * g));
                }
#else
                /* maddubs saturates its int16 pairs: unsigned |w| times qx carrying w's sign */
                const __m512i ws = _mm512_xor_si512(v, _mm512_set1_epi8(-128));
                const __m512i wa = _mm512_abs_epi8(ws);
                const __mmask64 neg = _mm512_movepi8_mask(ws);
                for (int t = 0; t < T; t++) {
                    const __m512i xg = bcast4(x[t * ldx + b].q + 4 * g);
                    s[t] = dot_acc512(s[t], wa,
                                      _mm512_mask_sub_epi8(xg, neg, _mm512_setzero_si512(), xg));
                    if (x2) {
                        const __m512i yg = bcast4(x2[t * ldx + b].q + 4 * g);
                        s2[t] = dot_acc512(
                            s2[t], wa, _mm512_mask_sub_epi8(yg, neg, _mm512_setzero_si512(), yg));
                    }
                }
#endif
            }
        } else {
#pragma GCC unroll 8
            for (int g = 0; g < 4; g++) {
                const __m512i v = _mm512_loadu_si512(q + 4 * QG * g);
                prefetch_slot(p, bytes, g, 4);
                const __m512i lo = _mm512_and_si512(v, nib);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                for (int t = 0; t < T; t++) {
                    const int8_t *xq = x[t * ldx + b].q;
                    s[t] = dot_acc512(dot_acc512(s[t], lo, bcast4(xq + 4 * g)), hi,
                                      bcast4(xq + 16 + 4 * g));
                    if (x2) {
                        const int8_t *yq = x2[t * ldx + b].q;
                        s2[t] = dot_acc512(dot_acc512(s2[t], lo, bcast4(yq + 4 * g)), hi,
                                           bcast4(yq + 16 + 4 * g));
                    }
                }
            }
        }
        const __m512 d = halves16(p);
        const __m512 m = qtype == Q4_1 ? halves16(p + 2 * QG) : d;
        for (int t = 0; t < T; t++) {
            const q8a_block *xb = x + t * ldx + b;
            float sum = xb->s;
            acc0[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xb->d)),
                                      _mm512_cvtepi32_ps(s[t]), acc0[t]);
            if (x2) {
                const q8a_block *yb = x2 + t * ldx + b;
                acc1[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(yb->d)),
                                          _mm512_cvtepi32_ps(s2[t]), acc1[t]);
                sum += yb->s;
            }
            if (qtype == Q4_1)
                acc1[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum), acc1[t]);
            else if (qtype == Q4_0)
                acc1[t] = _mm512_fmadd_ps(d, _mm512_set1_ps(-8.f * sum), acc1[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + QG * t, _mm512_add_ps(acc0[t], acc1[t]));
}

#define TILE_FOR(Q, T)                                                                         \
    (x2 ? tile_x16(Q, T, w, nb, x, x2, ldx, xsum, out)                                          \
        : tile_x16(Q, T, w, nb, x, 0, ldx, xsum, out))
#define BY_ROWS(Q)                                                                             \
    switch (rows) {                                                                            \
    case 1: TILE_FOR(Q, 1); break;                                                             \
    case 2: TILE_FOR(Q, 2); break;                                                             \
    case 3: TILE_FOR(Q, 3); break;                                                             \
    default: TILE_FOR(Q, 4); break;                                                            \
    }

_Static_assert(QT == 4, "BY_ROWS instantiates tiles of 1 .. 4 rows");

static void tile_q8_0(const uint8_t *w, int64_t nb, const q8a_block *x, const q8a_block *x2,
                      int64_t ldx, int rows, const int32_t *xsum, float *out)
{
    BY_ROWS(Q8_0)
}

static void tile_q4_0(const uint8_t *w, int64_t nb, const q8a_block *x, const q8a_block *x2,
                      int64_t ldx, int rows, const int32_t *xsum, float *out)
{
    BY_ROWS(Q4_0)
}

static void tile_q4_1(const uint8_t *w, int64_t nb, const q8a_block *x, const q8a_block *x2,
                      int64_t ldx, int rows, const int32_t *xsum, float *out)
{
    BY_ROWS(Q4_1)
}

void quant_x8_tile_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                       const q8a_block *x2, int64_t ldx, int rows, const int32_t *xsum,
                       float *out)
{
    if (qtype == Q8_0)
        tile_q8_0(w, k / QK, x, x2, ldx, rows, xsum, out);
    else if (qtype == Q4_0)
        tile_q4_0(w, k / QK, x, x2, ldx, rows, xsum, out);
    else
        tile_q4_1(w, k / QK, x, x2, ldx, rows, xsum, out);
}

#elif defined(CONVEYOR_AVX2) && defined(__F16C__)

/* The block's eight integer sums (half hf of the group) against one activation block. */
static inline __attribute__((always_inline)) __m256i
block_isums(int qtype, const uint8_t *q, const int8_t *qx)
{
    __m256i isum = _mm256_setzero_si256();
    if (qtype == Q8_0) {
        for (int g = 0; g < 8; g++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 4 * QG * g));
            const __m256i w = _mm256_xor_si256(v, _mm256_set1_epi8(-128)); /* signed again */
            /* unsigned |w| times qx carrying w's sign */
            isum = dot_acc(isum, _mm256_sign_epi8(w, w), _mm256_sign_epi8(quad(qx, g), w));
        }
    } else {
        const __m256i nib = _mm256_set1_epi8(15);
        for (int g = 0; g < 4; g++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 4 * QG * g));
            isum = dot_acc(isum, _mm256_and_si256(v, nib), quad(qx, g));
            isum = dot_acc(isum, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib), quad(qx, 4 + g));
        }
    }
    return isum;
}

/* Eight rows' dot products (half hf of a group) with one activation row of nb blocks;
 * inlined into one copy per type and pass count. */
static inline __attribute__((always_inline)) void
half_dot(const int qtype, const uint8_t *w, int hf, int64_t nb, const q8a_block *x,
         const q8a_block *x2, float *out)
{
    const int64_t bytes = x16_block_bytes(qtype);
    const int head = header_bytes(qtype);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * bytes, *q = p + head + 32 * hf;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * hf)));
        float s = x[b].s;
        acc0 = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[b].d)),
                               _mm256_cvtepi32_ps(block_isums(qtype, q, x[b].q)), acc0);
        if (x2) {
            acc1 = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x2[b].d)),
                                   _mm256_cvtepi32_ps(block_isums(qtype, q, x2[b].q)), acc1);
            s += x2[b].s;
        }
        if (qtype == Q4_1) {
            const __m256 m =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * QG + 16 * hf)));
            acc1 = _mm256_fmadd_ps(m, _mm256_set1_ps(s), acc1);
        } else if (qtype == Q4_0) {
            acc1 = _mm256_fmadd_ps(d, _mm256_set1_ps(-8.f * s), acc1);
        }
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc0, acc1));
}

#define HALF_DOT_FOR(T)                                                                        \
    (x2 ? half_dot(T, w, hf, nb, x, x2, out) : half_dot(T, w, hf, nb, x, 0, out))

static void row_dot(int qtype, const uint8_t *w, int hf, int64_t nb, const q8a_block *x,
                    const q8a_block *x2, float *out)
{
    if (qtype == Q8_0)
        HALF_DOT_FOR(Q8_0);
    else if (qtype == Q4_0)
        HALF_DOT_FOR(Q4_0);
    else
        HALF_DOT_FOR(Q4_1);
}

void quant_x8_tile_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                       const q8a_block *x2, int64_t ldx, int rows, const int32_t *xsum,
                       float *out)
{
    (void)xsum;
    for (int t = 0; t < rows; t++)
        for (int hf = 0; hf < 2; hf++)
            row_dot(qtype, w, hf, k / QK, x + t * ldx, x2 ? x2 + t * ldx : 0,
                    out + QG * t + 8 * hf);
}

#else

static inline int quant(int qtype, const uint8_t *q, int r, int j)
{
    if (qtype == Q8_0) return (int)q[4 * QG * (j / 4) + 4 * r + j % 4] - 128;
    const int jj = j % 16;
    const uint8_t byte = q[4 * QG * (jj / 4) + 4 * r + jj % 4];
    return j < 16 ? byte & 15 : byte >> 4;
}

void quant_x8_tile_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                       const q8a_block *x2, int64_t ldx, int rows, const int32_t *xsum,
                       float *out)
{
    const int64_t bytes = x16_block_bytes(qtype), nb = k / QK;
    const int head = header_bytes(qtype);
    (void)xsum;
    for (int t = 0; t < rows; t++) {
        const q8a_block *xt = x + t * ldx, *yt = x2 ? x2 + t * ldx : 0;
        for (int r = 0; r < QG; r++) {
            float acc = 0.f, extra = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *p = w + b * bytes;
                uint16_t h;
                memcpy(&h, p + 2 * r, 2);
                const float d = half_to_float(h);
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
                    memcpy(&h, p + 2 * QG + 2 * r, 2);
                    extra += half_to_float(h) * s;
                } else if (qtype == Q4_0) {
                    extra += d * (-8.f * s);
                }
            }
            out[QG * t + r] = acc + extra;
        }
    }
}

#endif

void quant_x8_row_dequantize(int qtype, const uint8_t *w, int r, int64_t k, float *out)
{
    const int64_t bytes = x16_block_bytes(qtype);
    const int head = header_bytes(qtype);
    for (int64_t b = 0; b < k / QK; b++, out += QK) {
        const uint8_t *p = w + b * bytes, *q = p + head;
        uint16_t h;
        memcpy(&h, p + 2 * r, 2);
        const float d = half_to_float(h);
        float mn = 0.f;
        if (qtype == Q4_1) {
            memcpy(&h, p + 2 * QG + 2 * r, 2);
            mn = half_to_float(h);
        }
        for (int j = 0; j < QK; j++) {
            if (qtype == Q8_0) {
                out[j] = d * (float)((int)q[4 * QG * (j / 4) + 4 * r + j % 4] - 128);
                continue;
            }
            const int jj = j % 16;
            const uint8_t byte = q[4 * QG * (jj / 4) + 4 * r + jj % 4];
            const int v = j < 16 ? byte & 15 : byte >> 4;
            out[j] = qtype == Q4_1 ? d * (float)v + mn : d * (float)(v - 8);
        }
    }
}

#ifdef CONVEYOR_QUANT_PANELS

void quant_x8_group_panel(int qtype, const uint8_t *w, int64_t k, uint16_t *panel)
{
    const int64_t bytes = x16_block_bytes(qtype);
    const int head = header_bytes(qtype);
    const __m512i nib = _mm512_set1_epi8(15);
    /* weight j of a block starts pair j / 2 of its panel: panel + j * QG */
    for (int64_t b = 0; b < k / QK; b++, panel += QK * QG) {
        const uint8_t *p = w + b * bytes, *q = p + head;
        const __m512 d = halves16(p);
        if (qtype == Q8_0) { /* stored + 128 */
            for (int g = 0; g < 8; g++)
                panel_columns4(_mm512_loadu_si512(q + 4 * QG * g), 128, d, _mm512_setzero_ps(),
                               panel + 4 * g * QG);
            continue;
        }
        /* Q4_1: d q + m, as d q - (-m); Q4_0: d (q - 8) */
        const __m512 mn = qtype == Q4_1 ? _mm512_sub_ps(_mm512_setzero_ps(), halves16(p + 2 * QG))
                                        : _mm512_setzero_ps();
        const int off = qtype == Q4_1 ? 0 : 8;
        for (int g = 0; g < 4; g++) { /* weights 4g .. 4g + 3 (low nibbles), 16 + 4g .. (high) */
            const __m512i v = _mm512_loadu_si512(q + 4 * QG * g);
            panel_columns4(_mm512_and_si512(v, nib), off, d, mn, panel + 4 * g * QG);
            panel_columns4(_mm512_and_si512(_mm512_srli_epi16(v, 4), nib), off, d, mn,
                           panel + (16 + 4 * g) * QG);
        }
    }
}

#endif

/* The K-quants Q4_K, Q5_K and Q6_K (quant_layout.h) against 8-bit activation blocks,
 * AVX-512BW. Each block of 32 weights lines up with one Q8A activation block (dx, qx[32],
 * s = dx sum(qx)), and its contribution is
 *
 *     Q4_K, Q5_K  (d s_j) dx sum(q qx) - (dmin m_j) s
 *     Q6_K        d dx (sc_a (sum_a q qx - 32 sum_a qx) + sc_b (...)), a, b its two halves
 *
 * sixteen rows at once: an integer sum per lane, the lanes' scales converted together.
 *
 * A tile of up to QT rows of x (and both passes) takes each 64-byte load of quants, unpacked
 * once (nibbles split, Q5_K / Q6_K's high bits merged), into every row's sums (one dpbusd
 * each, the row's four quants broadcast from memory); the sub-block scales are decoded once
 * per tile. Per activation row the integer sums and the float operations, in order, are
 * those of one row alone, so a row's result does not depend on the tile it ran in.
 * quant_k_avx2.c and quant_k_generic.c give the same sums.
 */
#include "kernels.h"

#ifdef CONVEYOR_QUANT_AVX512

#include "quant_layout.h"
#include "quant_simd.h"

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

#define TILE(TYPE, T, x_, x2_, out_)                                                           \
    (TYPE == Q6_K ? tile_q6k(T, w, k / QK_K, x_, x2_, ldx, xsum, out_)                          \
                  : tile_q45k(TYPE, T, w, k / QK_K, x_, x2_, ldx, out_))
#define QUANT_TYPES K_TYPES
#define DOT_ISA avx512
#include "quant_entries.h"

#endif

/* Q8_0, Q4_0, Q4_1 and MXFP4 (quant_layout.h) against 8-bit activation blocks, AVX-512BW: a
 * tile of up to QT activation rows (both passes) takes each 64-byte load of quants, unpacked once,
 * into every row's sums (dpbusd with AVX-512 VNNI, maddubs + madd without); per row the
 * integer sums and the float operations, in order, are those of the row alone (its result
 * does not depend on the tile). Per block and row the arithmetic is quant_linear.c's (its
 * header): d dx sum(q qx), minus 8 d s (Q4_0) or plus m s (Q4_1), with the second activation
 * pass added the same way. MXFP4's nibbles become their values + 12 by one byte shuffle per
 * load, Q4_0's arithmetic from there, the sums started from -12 sum(qx) (XSUM_MXFP4).
 * quant_x8_avx2.c and quant_x8_generic.c give the same sums.
 */
#include "kernels.h"

#ifdef CONVEYOR_QUANT_AVX512

#include "quant_layout.h"
#include "quant_simd.h"

/* `T` activation rows (ldx blocks apart; x2 their second pass, or NULL) against a group's
 * sixteen rows, nb blocks; inlined into one copy per type, tile height and pass count. */
static inline __attribute__((always_inline)) void
tile_x16(const int qtype, const int T, const uint8_t *w, int64_t nb, const q8a_block *x,
         const q8a_block *x2, int64_t ldx, const int32_t *xsum, float *out)
{
    const int64_t bytes = x8_block_bytes(qtype);
    const int head = header_bytes(qtype);
    const __m512i nib = _mm512_set1_epi8(15);
    const int32_t *xsum2 = xsum ? xsum + 2 * (x2 - x) : 0;
    (void)xsum2; /* read by MXFP4 and the dpbusd path of Q8_0 only */
    const __m512i table = _mm512_broadcast_i32x4(mxfp4_table());
    (void)table;
    __m512 acc0[QT], acc1[QT];
    for (int t = 0; t < T; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * bytes, *q = p + head;
        __m512i s[QT], s2[QT];
        for (int t = 0; t < T; t++) {
            /* MXFP4 from -12 sum(qx), Q8_0 (dpbusd) from -128 sum(qx): the weights' offsets */
#ifdef __AVX512VNNI__
            const int seeded = qtype == Q8_0 || qtype == MXFP4;
#else
            const int seeded = qtype == MXFP4;
#endif
            if (seeded) {
                s[t] = _mm512_set1_epi32(xsum[2 * (t * ldx + b)]);
                if (x2) s2[t] = _mm512_set1_epi32(xsum2[2 * (t * ldx + b)]);
                continue;
            }
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
                __m512i lo = _mm512_and_si512(v, nib);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                if (qtype == MXFP4) {
                    lo = _mm512_shuffle_epi8(table, lo);
                    hi = _mm512_shuffle_epi8(table, hi);
                }
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
        const __m512 d = qtype == MXFP4 ? e8m0_halves16(p) : halves16(p);
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

#define TILE(TYPE, T, x_, x2_, out_) tile_x16(TYPE, T, w, k / QK, x_, x2_, ldx, xsum, out_)
#define QUANT_TYPES X8_TYPES
#define DOT_ISA avx512
#include "quant_entries.h"

#endif

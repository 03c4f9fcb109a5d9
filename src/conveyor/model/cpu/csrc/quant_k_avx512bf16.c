/* Q4_K, Q5_K and Q6_K groups (quant_layout.h) dequantized into one bf16 panel each for
 * quant_gemm.c (AVX-512BW with AVX512-BF16): the weights of dequantize_*_f32, rounded to
 * nearest even. */
#include "kernels.h"

#ifdef CONVEYOR_QUANT_PANELS

#include "quant_layout.h"
#include "quant_simd.h"

static inline __attribute__((always_inline)) void
group_panel(const int qtype, const uint8_t *w, int64_t k, uint16_t *panel)
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

#define TO_PANEL group_panel
#define QUANT_TYPES K_TYPES
#include "quant_entries.h"

#endif

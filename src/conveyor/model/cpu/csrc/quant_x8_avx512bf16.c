/* Q8_0, Q4_0, Q4_1 and MXFP4 groups (quant_layout.h) dequantized into one bf16 panel each for
 * quant_gemm.c (AVX-512BW with AVX512-BF16): the weights of dequantize_*_f32, rounded to
 * nearest even. */
#include "kernels.h"

#ifdef CONVEYOR_QUANT_PANELS

#include "quant_layout.h"
#include "quant_simd.h"

static inline __attribute__((always_inline)) void
group_panel(const int qtype, const uint8_t *w, int64_t k, uint16_t *panel)
{
    const int64_t bytes = x8_block_bytes(qtype);
    const int head = header_bytes(qtype);
    const __m512i nib = _mm512_set1_epi8(15);
    /* weight j of a block starts pair j / 2 of its panel: panel + j * QG */
    for (int64_t b = 0; b < k / QK; b++, panel += QK * QG) {
        const uint8_t *p = w + b * bytes, *q = p + head;
        if (qtype == MXFP4) { /* each nibble's value + 12, less 12, times 2^(e - 128) */
            const __m512 e = e8m0_halves16(p), zero = _mm512_setzero_ps();
            const __m512i table = _mm512_broadcast_i32x4(mxfp4_table());
            for (int g = 0; g < 4; g++) {
                const __m512i v = _mm512_loadu_si512(q + 4 * QG * g);
                const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, nib));
                const __m512i hi =
                    _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
                panel_columns4(lo, MXFP4_OFFSET, e, zero, panel + 4 * g * QG);
                panel_columns4(hi, MXFP4_OFFSET, e, zero, panel + (16 + 4 * g) * QG);
            }
            continue;
        }
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

#define TO_PANEL group_panel
#define QUANT_TYPES X8_TYPES
#include "quant_entries.h"

#endif

/* Long prefills on GGUF blocks: out = x @ W^T + bias with W's interleaved groups
 * (quant_layout.h) dequantized into bfloat16 panels a slice at a time (the type's panel
 * function, quant_*_avx512bf16.c) and multiplied by the vdpbf16ps GEMM (gemm_avx512bf16.c;
 * builds with AVX512-BF16 only).
 *
 * The integer kernels' cost grows with the rows of x (each row two passes of dpbusd over every
 * weight); from 256 rows the bf16 GEMM does the same products faster even with the
 * dequantization, which costs per weight, not per row
 * (docs/kernels.md#measured-choices). A group of sixteen interleaved rows is exactly one panel
 * of sixteen output columns ([ceil(K / 2)][16][2] bf16, k in pairs, as CpuLinear packs them
 * before it groups them), so a slice of groups becomes a slice of panels: up to slice_bytes of
 * them at once (at least one), in a buffer the calling thread keeps, then one
 * gemm_bf16_bf16_grouped call (panels one to a group) writes their columns of out (x is
 * rounded to bf16 once per call: the slices are large).
 *
 * Numerics: the weights as dequantized in float32 (panel_*_bf16, the values of
 * dequantize_*_f32), rounded to bf16 (nearest even); x rounded to bf16 by the GEMM,
 * sums in float32. Closer to the file's float32 weights than one 8-bit pass of the
 * activations, further than two.
 */
#include "kernels.h"

#ifdef CONVEYOR_QUANT_PANELS

#include <stdlib.h>

static _Thread_local uint16_t *slice_buf;
static _Thread_local size_t slice_cap;

/* out[r, j] = sum_k x[r, k] W[j, k] + bias[j] for r < m, j < n (W as gemm_gguf_q8a takes it,
 * ldw bytes per group), through bf16 panels, about slice_bytes of them per GEMM call. Returns
 * 0, 1 for a type (or K) this file does not handle, 3 when out of memory (nothing written).
 * A build without AVX512-BF16 has no such entry point (cpu_kernels.py binds it where the
 * library has it). */
CONVEYOR_EXPORT int gemm_gguf_bf16(int qtype, const uint8_t *w, int64_t ldw, int64_t n,
                                   int64_t k, const float *x, int64_t ldx, int64_t m,
                                   const float *bias, float *out, int64_t ldo,
                                   int64_t slice_bytes, int num_threads)
{
    const quant_type *type = quant_type_of(qtype, k);
    if (!type) return 1;
    const quant_panel_fn to_panel = type->panel;
    const int64_t groups = (n + QG - 1) / QG, panel = k * QG; /* uint16 per panel */
    int64_t per_slice = slice_bytes / (2 * panel);
    per_slice = per_slice < 1 ? 1 : per_slice > groups ? groups : per_slice;
    const size_t need = (size_t)(per_slice * panel) * sizeof(uint16_t);
    if (need > slice_cap) {
        uint16_t *grown = aligned_alloc(64, (need + 63) / 64 * 64);
        if (!grown) return 3;
        free(slice_buf);
        slice_buf = grown, slice_cap = need;
    }
    uint16_t *buf = slice_buf;
    for (int64_t g0 = 0; g0 < groups; g0 += per_slice) {
        const int64_t count = groups - g0 < per_slice ? groups - g0 : per_slice;
        #pragma omp parallel for num_threads(num_threads) schedule(static) if (count > 1)
        for (int64_t g = 0; g < count; g++) to_panel(w + (g0 + g) * ldw, k, buf + g * panel);
        const int64_t j0 = g0 * QG, cols = n - j0 < count * QG ? n - j0 : count * QG;
        gemm_bf16_bf16_grouped(x, ldx, m, buf, cols, k, bias ? bias + j0 : 0, out + j0, ldo,
                               num_threads, 1);
    }
    return 0;
}

#endif

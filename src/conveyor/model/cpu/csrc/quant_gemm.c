/* Long prefills on GGUF blocks: out = x @ W^T + bias with W's interleaved groups (quant_x8.c,
 * quant_k.c) dequantized into bfloat16 panels a slice at a time and multiplied by linear.c's
 * vdpbf16ps GEMM (builds with AVX512-BF16 only).
 *
 * The integer kernels' cost grows with the rows of x (each row two passes of dpbusd over every
 * weight); from 256 rows the bf16 GEMM does the same products 1.2-1.7x faster (by type) even
 * with the dequantization, which costs per weight, not per row
 * (docs/kernels.md#measured-choices). A group of sixteen interleaved rows is exactly one panel
 * of sixteen output columns ([ceil(K / 2)][16][2] bf16, k in pairs, as CpuLinear packs them
 * before it groups them), so a slice of groups becomes a slice of panels: up to slice_bytes of
 * them at once (at least one), in a buffer the calling thread keeps, then one
 * conveyor_linear_bf16_grouped call (panels one to a group) writes their columns of out (x is
 * rounded to bf16 once per call: the slices are large).
 *
 * Numerics: the weights as dequantized in float32 (quant_*_group_panel, the values of
 * quant_*_row_dequantize), rounded to bf16 (nearest even); x rounded to bf16 by the GEMM,
 * sums in float32. Closer to the file's float32 weights than one 8-bit pass of the
 * activations, further than two.
 */
#include <stdlib.h>

#include "quant_blocks.h"

#ifdef CONVEYOR_QUANT_PANELS

void conveyor_linear_bf16_grouped(const float *x, int64_t ldx, int64_t m, const uint16_t *packed,
                                  int64_t n, int64_t k, const float *bias, float *out,
                                  int64_t ldo, int num_threads, int group);

static _Thread_local uint16_t *slice_buf;
static _Thread_local size_t slice_cap;

/* out[r, j] = sum_k x[r, k] W[j, k] + bias[j] for r < m, j < n (W as
 * conveyor_quant_linear_f32 takes it, ldw bytes per group), through bf16 panels, about
 * slice_bytes of them per GEMM call. Returns 0, 1 for a type (or K) this file does not
 * handle, 2 in a build without AVX512-BF16, 3 when out of memory (nothing written). */
int conveyor_quant_gemm_bf16(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                             const float *x, int64_t ldx, int64_t m, const float *bias,
                             float *out, int64_t ldo, int64_t slice_bytes, int num_threads)
{
    if (!quant_type_fits(qtype, k)) return 1;
    const int kquant = quant_k_block_bytes(qtype) > 0;
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
        for (int64_t g = 0; g < count; g++)
            if (kquant)
                quant_k_group_panel(qtype, w + (g0 + g) * ldw, k, buf + g * panel);
            else
                quant_x8_group_panel(qtype, w + (g0 + g) * ldw, k, buf + g * panel);
        const int64_t j0 = g0 * QG, cols = n - j0 < count * QG ? n - j0 : count * QG;
        conveyor_linear_bf16_grouped(x, ldx, m, buf, cols, k, bias ? bias + j0 : 0, out + j0,
                                     ldo, num_threads, 1);
    }
    return 0;
}

#else

int conveyor_quant_gemm_bf16(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                             const float *x, int64_t ldx, int64_t m, const float *bias,
                             float *out, int64_t ldo, int64_t slice_bytes, int num_threads)
{
    (void)qtype, (void)w, (void)ldw, (void)n, (void)k, (void)x, (void)ldx, (void)m;
    (void)bias, (void)out, (void)ldo, (void)slice_bytes, (void)num_threads;
    return 2; /* no vdpbf16ps GEMM in this build */
}

#endif

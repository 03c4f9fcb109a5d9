/* Linear layers on GGUF's quantized blocks: out = x @ W^T + bias for W [N, K] in Q8_0, Q4_0,
 * Q4_1 or MXFP4 (quant_x8_*.c) or a K-quant (Q4_K, Q5_K, Q6_K: quant_k_*.c), rows interleaved
 * sixteen at a time at load (conveyor.model.cpu.quant_linear.QuantLinear, quant_layout.h).
 * This file splits the work (quantize.c quantizes the activations; quant_types.c's table
 * leads a type to its dot product).
 *
 * The blocks (32 weights each, little-endian, d and m float16):
 *
 *     Q8_0  d, int8 q[32]                   w_j = d q_j                     34 bytes
 *     Q4_0  d, uint8 qs[16]                 w_j = d (q_j - 8)               18 bytes
 *     Q4_1  d, m, uint8 qs[16]              w_j = d q_j + m                 20 bytes
 *     MXFP4 uint8 e, qs[16]                 w_j = 2^(e - 128) v(q_j)        17 bytes
 *           q_j = qs[j] & 15 for j < 16, qs[j - 16] >> 4 for j >= 16; v: MXFP4's E2M1
 *           values doubled (quant_simd.h), e an E8M0 exponent byte
 *
 * The dot products the formats were designed for: each row of x is first quantized per block
 * of 32 to 8 bits (Q8A, quantize.c: dx = max|x| / 127, qx = round(x / dx), and
 * s = dx sum(qx)), so a block's contribution is one integer dot product and two scales:
 *
 *     Q8_0  d dx sum(q qx)        Q4_0  d (dx sum(q qx) - 8 s)        Q4_1  d dx sum(q qx) + m s
 *     MXFP4 2^(e - 128) dx sum(v qx)
 *
 * With two passes (the default of QuantLinear) the rounding error x - dx qx is quantized the
 * same way into a second set of blocks and its dot product added: 8-bit x 8-bit arithmetic
 * still, but x is then held to about 1 / 254^2 of each block's largest value instead of
 * 1 / 254. One pass is llama.cpp's arithmetic (Q8_0 / Q8_1 activations); on SmolLM2-135M it
 * moves near-tied logits by up to ~0.1 (its first answer token to "What is the capital of
 * France?" flips from "The" to "L", both in each other's top 5), where two passes keep the
 * fp32 answer.
 *
 * The integer dot: AVX2 `maddubs` (unsigned 4-bit x signed 8-bit into int16 pairs, then
 * `madd` into int32; Q8_0's signed weights through the sign trick |w| x sign(qx, w)), or
 * AVX-512 VNNI's `dpbusd` (the same in one instruction; Q8_0's weights stored + 128, so
 * (w + 128) qx less 128 sum(qx), since dpbusd does not saturate) where the build has it, on
 * 512-bit registers (a load holds four quants of each of a group's sixteen rows) where the
 * build has AVX-512BW, with maddubs there when it lacks VNNI; a plain C loop otherwise (the
 * portable build). All give the same integer sums; the float
 * scale products are summed per block in order, so results agree across builds to fp32
 * rounding.
 *
 * The activation quantization is the only approximation beyond the file's own: at most half
 * a step of the last pass per element of x (tests/model/test_quant_linear.py states the tolerance).
 *
 * Work split: threads take groups of sixteen weight rows (QG); each group's bytes stay in
 * L1 or L2 while tiles of up to QT activation rows pass over them. A tile unpacks each load
 * of weights once for all its rows (AVX-512; the AVX2 and portable paths take its rows one
 * by one), which a decode step of many sequences needs: before tiles, every row redid the
 * nibble split and scale decoding, and 16 rows cost about 16 times one row's work.
 */
#include <stdlib.h>

#include "kernels.h"

/* The activation sums kernels.h describes (XSUM_Q6_K, XSUM_Q8_0 or XSUM_MXFP4) of block x, at
 * s[0..2). */
static inline void block_xsum(int kind, const q8a_block *x, int32_t *s)
{
    int32_t lo = 0, hi = 0;
    for (int j = 0; j < QK / 2; j++) lo += x->q[j], hi += x->q[QK / 2 + j];
    if (kind == XSUM_Q6_K) {
        s[0] = -32 * lo;
        s[1] = -32 * hi;
    } else {
        s[0] = (kind == XSUM_MXFP4 ? -12 : -128) * (lo + hi);
        s[1] = 0;
    }
}

/* block_xsum of passes x m rows of nb blocks, split among the team (own: all by the calling
 * thread, into its own xsum). */
static void fill_xsum(int kind, const q8a_block *x, int64_t rows, int64_t nb, int32_t *xsum,
                      int own)
{
    if (own) {
        for (int64_t i = 0; i < rows * nb; i++) block_xsum(kind, x + i, xsum + 2 * i);
        return;
    }
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * nb; i++) block_xsum(kind, x + i, xsum + 2 * i);
}

/* out[r, j] = sum_k xq[r, k] W[j, k] + bias[j] for r < m, j < n, xq from quantize_q8a_f32
 * with the same passes, bias NULL or [n]. W: ceil(n / 16) groups of sixteen interleaved rows
 * (quant_layout.h), ldw bytes apart. Up to max_tile (1 .. QT) activation rows share each pass
 * over a group's unpacked weights; 1 is one row at a time (each row's result is the same
 * either way, bit for bit). Returns 0, 1 for a type (or a K-quant width) this file does not
 * handle, 3 when out of memory (nothing written either way). */
static int quant_linear_team(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                             const void *xq, int64_t m, int passes, const float *bias,
                             float *out, int64_t ldo, int max_tile, int own)
{
    const int64_t nb = k / QK;
    const quant_type *type = quant_type_of(qtype, k);
    if (!type) return 1;
    const quant_dot_fn dot = type->dot;
    const q8a_block *x = (const q8a_block *)xq, *x2 = passes > 1 ? x + m * nb : 0;
    const int64_t tile = max_tile < 1 ? 1 : max_tile > QT ? QT : max_tile;
    const int sums = type->xsum != XSUM_NONE;
    const int64_t sum_rows = (passes > 1 ? 2 : 1) * m;
    /* own: xq is this thread's own (quantize_q8a_f32_own, at most quantize_q8a_own_bytes), and
     * so are its sums, on the stack (a fifth of xq's bytes) */
    int32_t own_sums[own && sums ? sum_rows * nb * 2 : 1];
    int32_t *xsum = 0;
    if (sums && own) {
        xsum = own_sums;
        fill_xsum(type->xsum, x, sum_rows, nb, xsum, 1);
    } else if (sums) {
        #pragma omp single copyprivate(xsum)
        xsum = malloc((size_t)(sum_rows * nb * 2) * sizeof *xsum);
        if (!xsum) return 3;
        fill_xsum(type->xsum, x, sum_rows, nb, xsum, 0);
    }
    /* a task: one group of sixteen weight rows against every activation row, a tile at a
     * time, the group's bytes staying in cache */
    const int64_t tasks = (n + QG - 1) / QG;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t j0 = QG * t, cols = n - j0 < QG ? n - j0 : QG;
        for (int64_t r0 = 0; r0 < m; r0 += tile) {
            const int rows = (int)(m - r0 < tile ? m - r0 : tile);
            const q8a_block *xr = x + r0 * nb, *x2r = x2 ? x2 + r0 * nb : 0;
            const int32_t *sr = xsum ? xsum + 2 * r0 * nb : 0;
            float dots[QT * QG];
            dot(w + t * ldw, k, xr, x2r, nb, rows, sr, dots);
            for (int r = 0; r < rows; r++)
                for (int64_t i = 0; i < cols; i++)
                    out[(r0 + r) * ldo + j0 + i] = dots[QG * r + i] + (bias ? bias[j0 + i] : 0.f);
        }
    }
    if (!own) {
        #pragma omp single nowait
        free(xsum); /* after the loop's barrier: no thread reads it any more */
    }
    return 0;
}

CONVEYOR_EXPORT int gemm_gguf_q8a(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                                  const void *xq, int64_t m, int passes, const float *bias,
                                  float *out, int64_t ldo, int num_threads, int max_tile)
{
    const int64_t tasks = (n + QG - 1) / QG;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) \
        if (tasks > 1 && m * n * (k / QK) >= QUANT_PARALLEL_MIN_BLOCKS)
    {
        const int mine = quant_linear_team(qtype, w, ldw, n, k, xq, m, passes, bias, out, ldo,
                                           max_tile, 0);
        #pragma omp master
        failed = mine; /* the same in every thread */
    }
    return failed;
}

/* Tiles of QT rows. Every thread of the caller's team calls it with the same arguments (but
 * xq, when own: each thread's own copy of the same blocks, quantize_q8a_f32_own's); it
 * returns (the same value in each) after the team's barrier. */
int gemm_gguf_q8a_team(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                       const void *xq, int64_t m, int passes, const float *bias, float *out,
                       int64_t ldo, int own)
{
    return quant_linear_team(qtype, w, ldw, n, k, xq, m, passes, bias, out, ldo, QT, own);
}

/* Rows ids[i] (i < count) of W (n rows, laid out as gemm_gguf_q8a takes them) dequantized to
 * float32 out [count, k] (ldo apart): the embedding lookup of a quantized embedding, and a
 * quantized linear's weight for prefill-sized GEMMs. Returns 0, 1 for an unknown type, 2 for
 * an id outside [0, n) (its row is left as it was). */
CONVEYOR_EXPORT int rows_gguf_f32(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                                  const int64_t *ids, int64_t count, float *out, int64_t ldo,
                                  int num_threads)
{
    const quant_type *type = quant_type_of(qtype, k);
    if (!type) return 1;
    const quant_row_fn dequantize = type->dequantize;
    int failed = 0;
    #pragma omp parallel for num_threads(num_threads) schedule(static) reduction(max : failed) \
        if (count * k >= 64 * 1024)
    for (int64_t i = 0; i < count; i++) {
        if (ids[i] < 0 || ids[i] >= n) {
            failed = 2;
            continue;
        }
        dequantize(w + ids[i] / QG * ldw, (int)(ids[i] % QG), k, out + i * ldo);
    }
    return failed;
}

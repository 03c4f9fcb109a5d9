/* Linear layers on GGUF's quantized blocks: out = x @ W^T + bias for W [N, K] in Q8_0, Q4_0
 * or Q4_1 (quant_x8.c) or a K-quant (Q4_K, Q5_K, Q6_K: quant_k.c), rows interleaved sixteen
 * at a time at load (conveyor.model.cpu.quant_linear.QuantLinear). This file quantizes the
 * activations and splits the work.
 *
 * The blocks (32 weights each, little-endian, d and m float16):
 *
 *     Q8_0  d, int8 q[32]                   w_j = d q_j                     34 bytes
 *     Q4_0  d, uint8 qs[16]                 w_j = d (q_j - 8)               18 bytes
 *     Q4_1  d, m, uint8 qs[16]              w_j = d q_j + m                 20 bytes
 *           q_j = qs[j] & 15 for j < 16, qs[j - 16] >> 4 for j >= 16
 *
 * The dot products the formats were designed for: each row of x is first quantized per block
 * of 32 to 8 bits (Q8A below: dx = max|x| / 127, qx = round(x / dx), and s = dx sum(qx)), so a
 * block's contribution is one integer dot product and two scales:
 *
 *     Q8_0  d dx sum(q qx)        Q4_0  d (dx sum(q qx) - 8 s)        Q4_1  d dx sum(q qx) + m s
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
#include <math.h>

#include "quant_blocks.h"

#define PARALLEL_MIN_BLOCKS 4096

static void quantize_block(const float *v, q8a_block *o)
{
    float amax = 0.f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        const int q = (int)lrintf(v[j] * inv);
        o->q[j] = (int8_t)q;
        sum += q;
    }
    o->d = d;
    o->s = d * (float)sum;
}

#ifdef CONVEYOR_AVX512
/* quantize_block on a block in two zmm registers, bit for bit: the same largest |x|, the same
 * division and reciprocal, the products rounded to nearest even (cvtps_epi32, as lrintf in the
 * default rounding mode) and the same integer sum; rest (NULL: none) gets x - d q, rounded
 * product then difference, as the scalar loop (no contraction under -std=c11). libm's fmaxf
 * and lrintf are calls per element there: this is most of a decode step's quantization. */
static inline void quantize_block512(const float *v, q8a_block *o, float *rest)
{
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i *)o->q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(o->q + 16), _mm512_cvtepi32_epi8(qb));
    o->d = d;
    o->s = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    if (rest) {
        const __m512 vd = _mm512_set1_ps(d);
        _mm512_storeu_ps(rest, _mm512_sub_ps(a, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(qa))));
        _mm512_storeu_ps(rest + 16, _mm512_sub_ps(b, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(qb))));
    }
}
#endif

/* Row x [nb x 32] into nb Q8A blocks at o, and with a second pass (o2 not NULL) its rounding
 * error into nb more at o2. */
static void quantize_row(const float *x, int64_t nb, q8a_block *o, q8a_block *o2)
{
    for (int64_t b = 0; b < nb; b++) {
        const float *v = x + b * QK;
#ifdef CONVEYOR_AVX512
        float rest[QK];
        quantize_block512(v, o + b, o2 ? rest : 0);
        if (o2) quantize_block512(rest, o2 + b, 0);
#else
        quantize_block(v, o + b);
        if (o2) {
            float rest[QK];
            for (int j = 0; j < QK; j++) rest[j] = v[j] - o[b].d * o[b].q[j];
            quantize_block(rest, o2 + b);
        }
#endif
    }
}

/* Quantize m rows of x [m, k] (k a multiple of 32) into out: `passes` (1 or 2) sets of m rows
 * of k / 32 Q8A blocks, the second one the first's rounding error. Every thread of the
 * running parallel region's team calls it (decoder_layers.c, or the entry point below): the
 * rows split among them, returning after the team's barrier. */
void cv_quantize_q8a_team(const float *x, int64_t ldx, int64_t m, int64_t k, void *out,
                          int passes)
{
    const int64_t nb = k / QK;
    q8a_block *blocks = (q8a_block *)out;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * ldx, nb, blocks + r * nb, passes > 1 ? blocks + (m + r) * nb : 0);
}

/* The bytes cv_quantize_q8a_own writes for m rows of k, or 0 when that is more than a thread
 * should hold on its stack (OWN_XQ_BYTES): then the team quantizes into one shared buffer. */
#define OWN_XQ_BYTES (32 << 10)
size_t cv_q8a_own_bytes(int64_t m, int64_t k, int passes)
{
    const size_t bytes = (size_t)(passes > 1 ? 2 : 1) * (size_t)m * (size_t)(k / QK) *
                         sizeof(q8a_block);
    return bytes <= OWN_XQ_BYTES ? bytes : 0;
}

/* cv_quantize_q8a_team's result, every row by the calling thread into out (its own buffer,
 * cv_q8a_own_bytes long), with no barrier: in a decode step each thread quantizes the row
 * itself rather than wait for one thread to. */
void cv_quantize_q8a_own(const float *x, int64_t ldx, int64_t m, int64_t k, void *out,
                         int passes)
{
    const int64_t nb = k / QK;
    q8a_block *blocks = (q8a_block *)out;
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * ldx, nb, blocks + r * nb, passes > 1 ? blocks + (m + r) * nb : 0);
}

void conveyor_quantize_q8a_f32(const float *x, int64_t ldx, int64_t m, int64_t k, void *out,
                               int passes, int num_threads)
{
    #pragma omp parallel num_threads(num_threads) if (m * (k / QK) >= PARALLEL_MIN_BLOCKS)
    cv_quantize_q8a_team(x, ldx, m, k, out, passes);
}

/* The activation sums quant_blocks.h describes (for Q6_K and Q8_0) of block x, at s[0..2). */
static inline void block_xsum(int qtype, const q8a_block *x, int32_t *s)
{
    int32_t lo = 0, hi = 0;
    for (int j = 0; j < QK / 2; j++) lo += x->q[j], hi += x->q[QK / 2 + j];
    if (qtype == Q6_K) {
        s[0] = -32 * lo;
        s[1] = -32 * hi;
    } else {
        s[0] = -128 * (lo + hi);
        s[1] = 0;
    }
}

/* block_xsum of passes x m rows of nb blocks, split among the team (own: all by the calling
 * thread, into its own xsum). */
static void fill_xsum(int qtype, const q8a_block *x, int64_t rows, int64_t nb, int32_t *xsum,
                      int own)
{
    if (own) {
        for (int64_t i = 0; i < rows * nb; i++) block_xsum(qtype, x + i, xsum + 2 * i);
        return;
    }
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * nb; i++) block_xsum(qtype, x + i, xsum + 2 * i);
}

/* out[r, j] = sum_k xq[r, k] W[j, k] + bias[j] for r < m, j < n, xq from
 * conveyor_quantize_q8a_f32 with the same passes, bias NULL or [n]. W: ceil(n / 16) groups
 * of sixteen interleaved rows (quant_x8.c's and quant_k.c's layouts), ldw bytes apart. Up to
 * max_tile (1 .. QT) activation rows share each pass over a group's unpacked weights; 1 is
 * one row at a time (each row's result is the same either way, bit for bit). Returns 0, 1
 * for a type (or a K-quant width) this file does not handle, 3 when out of memory (nothing
 * written either way). */
static int quant_linear_team(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                             const void *xq, int64_t m, int passes, const float *bias,
                             float *out, int64_t ldo, int max_tile, int own)
{
    const int64_t nb = k / QK;
    if (!quant_type_fits(qtype, k)) return 1;
    const int kquant = quant_k_block_bytes(qtype) > 0;
    const q8a_block *x = (const q8a_block *)xq, *x2 = passes > 1 ? x + m * nb : 0;
    const int64_t tile = max_tile < 1 ? 1 : max_tile > QT ? QT : max_tile;
    const int sums = qtype == Q6_K || qtype == Q8_0;
    const int64_t sum_rows = (passes > 1 ? 2 : 1) * m;
    /* own: xq is this thread's own (cv_quantize_q8a_own, at most OWN_XQ_BYTES), and so are
     * its sums, on the stack (a fifth of xq's bytes) */
    int32_t own_sums[own && sums ? sum_rows * nb * 2 : 1];
    int32_t *xsum = 0;
    if (sums && own) {
        xsum = own_sums;
        fill_xsum(qtype, x, sum_rows, nb, xsum, 1);
    } else if (sums) {
        #pragma omp single copyprivate(xsum)
        xsum = malloc((size_t)(sum_rows * nb * 2) * sizeof *xsum);
        if (!xsum) return 3;
        fill_xsum(qtype, x, sum_rows, nb, xsum, 0);
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
            if (kquant)
                quant_k_tile_dot(qtype, w + t * ldw, k, xr, x2r, nb, rows, sr, dots);
            else
                quant_x8_tile_dot(qtype, w + t * ldw, k, xr, x2r, nb, rows, sr, dots);
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

int conveyor_quant_linear_tiled_f32(int qtype, const uint8_t *w, int64_t ldw, int64_t n,
                                    int64_t k, const void *xq, int64_t m, int passes,
                                    const float *bias, float *out, int64_t ldo, int num_threads,
                                    int max_tile)
{
    const int64_t tasks = (n + QG - 1) / QG;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) \
        if (tasks > 1 && m * n * (k / QK) >= PARALLEL_MIN_BLOCKS)
    {
        const int mine = quant_linear_team(qtype, w, ldw, n, k, xq, m, passes, bias, out, ldo,
                                           max_tile, 0);
        #pragma omp master
        failed = mine; /* the same in every thread */
    }
    return failed;
}

/* For a caller already running a parallel region (decoder_layers.c): every thread of its team
 * calls it with the same arguments (but xq, when own: each thread's own copy of the same
 * blocks, cv_quantize_q8a_own's); it returns (the same value in each) after the team's
 * barrier. */
int cv_quant_linear_team(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                         const void *xq, int64_t m, int passes, const float *bias,
                         float *out, int64_t ldo, int own)
{
    return quant_linear_team(qtype, w, ldw, n, k, xq, m, passes, bias, out, ldo, QT, own);
}

/* conveyor_quant_linear_tiled_f32 with tiles of QT rows: what QuantLinear and the fused
 * decoder layers call. */
int conveyor_quant_linear_f32(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                              const void *xq, int64_t m, int passes, const float *bias,
                              float *out, int64_t ldo, int num_threads)
{
    return conveyor_quant_linear_tiled_f32(qtype, w, ldw, n, k, xq, m, passes, bias, out, ldo,
                                           num_threads, QT);
}

/* Rows ids[i] (i < count) of W (n rows, laid out as conveyor_quant_linear_f32 takes them)
 * dequantized to float32 out [count, k] (ldo apart): the embedding lookup of a quantized
 * embedding, and a quantized linear's weight for prefill-sized GEMMs. Returns 0, 1 for an
 * unknown type, 2 for an id outside [0, n) (its row is left as it was). */
int conveyor_quant_rows_f32(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                            const int64_t *ids, int64_t count, float *out, int64_t ldo,
                            int num_threads)
{
    if (!quant_type_fits(qtype, k)) return 1;
    const int kquant = quant_k_block_bytes(qtype) > 0;
    int failed = 0;
    #pragma omp parallel for num_threads(num_threads) schedule(static) reduction(max : failed) \
        if (count * k >= 64 * 1024)
    for (int64_t i = 0; i < count; i++) {
        if (ids[i] < 0 || ids[i] >= n) {
            failed = 2;
            continue;
        }
        if (kquant)
            quant_k_row_dequantize(qtype, w + ids[i] / QG * ldw, (int)(ids[i] % QG), k,
                                   out + i * ldo);
        else
            quant_x8_row_dequantize(qtype, w + ids[i] / QG * ldw, (int)(ids[i] % QG), k,
                                    out + i * ldo);
    }
    return failed;
}

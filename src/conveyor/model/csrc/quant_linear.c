/* Linear layers on GGUF's quantized blocks, kept as the file has them: out = x @ W^T + bias
 * for W [N, K] in Q8_0, Q4_0 or Q4_1 rows, or a K-quant's (Q4_K, Q5_K, Q6_K: quant_k.c
 * holds their super-block arithmetic) (conveyor.model.quant_linear.QuantLinear).
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
 * AVX-512 VNNI's `dpbusd` (the same in one instruction) where the build has it; a plain C
 * loop otherwise (the portable build). All three give the same integer sums; the float scale
 * products are summed per block in order, so results agree across builds to fp32 rounding.
 *
 * The activation quantization is the only approximation beyond the file's own: at most half
 * a step of the last pass per element of x (tests/test_quant_linear.py states the tolerance).
 *
 * Work split: threads take blocks of ROWS_PER_TASK weight rows; each weight row (a few hundred
 * bytes) stays in L1 while every activation row passes over it.
 */
#include <math.h>

#include "quant_blocks.h"

#define ROWS_PER_TASK 8
#define PARALLEL_MIN_BLOCKS 4096
typedef struct {
    uint16_t d;
    int8_t q[QK];
} q8_0_block;

typedef struct {
    uint16_t d;
    uint8_t qs[QK / 2];
} q4_0_block;

typedef struct {
    uint16_t d, m;
    uint8_t qs[QK / 2];
} q4_1_block;

_Static_assert(sizeof(q8_0_block) == 34, "Q8_0 layout");
_Static_assert(sizeof(q4_0_block) == 18, "Q4_0 layout");
_Static_assert(sizeof(q4_1_block) == 20, "Q4_1 layout");

static inline int nibble(const uint8_t *qs, int j)
{
    return j < QK / 2 ? qs[j] & 15 : qs[j - QK / 2] >> 4;
}


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

/* Quantize m rows of x [m, k] (k a multiple of 32) into out: `passes` (1 or 2) sets of m rows
 * of k / 32 Q8A blocks, the second one the first's rounding error. */
void conveyor_quantize_q8a_f32(const float *x, int64_t ldx, int64_t m, int64_t k, void *out,
                               int passes, int num_threads)
{
    const int64_t nb = k / QK;
    q8a_block *blocks = (q8a_block *)out;
    #pragma omp parallel for num_threads(num_threads) schedule(static) \
        if (m * nb >= PARALLEL_MIN_BLOCKS)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * ldx + b * QK;
            q8a_block *o = blocks + r * nb + b;
            quantize_block(v, o);
            if (passes > 1) {
                float rest[QK];
                for (int j = 0; j < QK; j++) rest[j] = v[j] - o->d * o->q[j];
                quantize_block(rest, o + m * nb);
            }
        }
    }
}

#ifdef CONVEYOR_AVX2

static inline __m256i unpack_nibbles(const uint8_t *qs)
{
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

/* One weight row against one activation row: the sum over nb blocks; x2: the second pass's
 * blocks, or NULL. */
static inline __attribute__((always_inline)) float
row_dot_impl(int qtype, const uint8_t *w, const q8a_block *x, const q8a_block *x2, int64_t nb,
             int two)
{
    __m256 acc = _mm256_setzero_ps();
    float extra = 0.f; /* the s terms: Q4_1's m s, Q4_0's -8 d s */
    for (int64_t b = 0; b < nb; b++) {
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x[b].q);
        const float s = two ? x[b].s + x2[b].s : x[b].s;
        __m256i u, sx, sx2 = _mm256_setzero_si256();
        float d;
        if (qtype == Q8_0) {
            const q8_0_block *blk = (const q8_0_block *)w + b;
            const __m256i q = _mm256_loadu_si256((const __m256i *)blk->q);
            d = half_to_float(blk->d);
            u = _mm256_sign_epi8(q, q);
            sx = _mm256_sign_epi8(qx, q);
            if (two) sx2 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x2[b].q), q);
        } else {
            const uint8_t *qs;
            if (qtype == Q4_1) {
                const q4_1_block *blk = (const q4_1_block *)w + b;
                d = half_to_float(blk->d);
                extra += half_to_float(blk->m) * s;
                qs = blk->qs;
            } else {
                const q4_0_block *blk = (const q4_0_block *)w + b;
                d = half_to_float(blk->d);
                extra -= 8.f * d * s;
                qs = blk->qs;
            }
            u = unpack_nibbles(qs);
            sx = qx;
            if (two) sx2 = _mm256_loadu_si256((const __m256i *)x2[b].q);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d), _mm256_cvtepi32_ps(dot_u8_s8(u, sx)),
                              acc);
        if (two)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x2[b].d),
                                  _mm256_cvtepi32_ps(dot_u8_s8(u, sx2)), acc);
    }
    return hsum(acc) + extra;
}

/* Four weight rows (ldw bytes apart) against one activation row, into out[0..4): four
 * independent accumulator chains, and each activation block loaded once for the four. */
static inline __attribute__((always_inline)) void
rows4_dot_impl(int qtype, const uint8_t *w, int64_t ldw, const q8a_block *x, const q8a_block *x2,
               int64_t nb, int two, float *out)
{
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    float extra[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t b = 0; b < nb; b++) {
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x[b].q);
        const __m256i qx2 = two ? _mm256_loadu_si256((const __m256i *)x2[b].q) : qx;
        const float s = two ? x[b].s + x2[b].s : x[b].s;
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const uint8_t *wi = w + i * ldw;
            __m256i u, sx, sx2 = qx2;
            float d;
            if (qtype == Q8_0) {
                const q8_0_block *blk = (const q8_0_block *)wi + b;
                const __m256i q = _mm256_loadu_si256((const __m256i *)blk->q);
                d = half_to_float(blk->d);
                u = _mm256_sign_epi8(q, q);
                sx = _mm256_sign_epi8(qx, q);
                if (two) sx2 = _mm256_sign_epi8(qx2, q);
            } else if (qtype == Q4_1) {
                const q4_1_block *blk = (const q4_1_block *)wi + b;
                d = half_to_float(blk->d);
                extra[i] += half_to_float(blk->m) * s;
                u = unpack_nibbles(blk->qs);
                sx = qx;
            } else {
                const q4_0_block *blk = (const q4_0_block *)wi + b;
                d = half_to_float(blk->d);
                extra[i] -= 8.f * d * s;
                u = unpack_nibbles(blk->qs);
                sx = qx;
            }
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d),
                                     _mm256_cvtepi32_ps(dot_u8_s8(u, sx)), acc[i]);
            if (two)
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * x2[b].d),
                                         _mm256_cvtepi32_ps(dot_u8_s8(u, sx2)), acc[i]);
        }
    }
    for (int i = 0; i < 4; i++) out[i] = hsum(acc[i]) + extra[i];
}

#else

/* The integer dot of one weight block with 32 activation quants. */
static inline int32_t block_isum(int qtype, const uint8_t *w, int64_t b, const int8_t *qx)
{
    int32_t isum = 0;
    if (qtype == Q8_0) {
        const q8_0_block *blk = (const q8_0_block *)w + b;
        for (int j = 0; j < QK; j++) isum += blk->q[j] * qx[j];
    } else {
        const uint8_t *qs = qtype == Q4_1 ? ((const q4_1_block *)w + b)->qs
                                          : ((const q4_0_block *)w + b)->qs;
        for (int j = 0; j < QK; j++) isum += nibble(qs, j) * qx[j];
    }
    return isum;
}

static inline float row_dot_impl(int qtype, const uint8_t *w, const q8a_block *x,
                                 const q8a_block *x2, int64_t nb, int two)
{
    float acc = 0.f, extra = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const float s = two ? x[b].s + x2[b].s : x[b].s;
        float d;
        if (qtype == Q4_1) {
            const q4_1_block *blk = (const q4_1_block *)w + b;
            d = half_to_float(blk->d);
            extra += half_to_float(blk->m) * s;
        } else if (qtype == Q4_0) {
            d = half_to_float(((const q4_0_block *)w + b)->d);
            extra -= 8.f * d * s;
        } else {
            d = half_to_float(((const q8_0_block *)w + b)->d);
        }
        acc += d * x[b].d * (float)block_isum(qtype, w, b, x[b].q);
        if (two) acc += d * x2[b].d * (float)block_isum(qtype, w, b, x2[b].q);
    }
    return acc + extra;
}

static inline void rows4_dot_impl(int qtype, const uint8_t *w, int64_t ldw, const q8a_block *x,
                                  const q8a_block *x2, int64_t nb, int two, float *out)
{
    for (int i = 0; i < 4; i++) out[i] = row_dot_impl(qtype, w + i * ldw, x, x2, nb, two);
}

#endif

static int64_t block_bytes(int qtype)
{
    switch (qtype) {
    case Q8_0: return sizeof(q8_0_block);
    case Q4_0: return sizeof(q4_0_block);
    case Q4_1: return sizeof(q4_1_block);
    default: return 0;
    }
}

/* out[r, j] = sum_k xq[r, k] W[j, k] + bias[j] for r < m, j < n: W as n rows of k / 32 blocks
 * of qtype (row after row, ldw bytes apart), xq from conveyor_quantize_q8a_f32 with the same
 * passes, bias NULL or [n]. Returns 0, or 1 for a type this file does not handle (nothing
 * written). */
int conveyor_quant_linear_f32(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                              const void *xq, int64_t m, int passes, const float *bias,
                              float *out, int64_t ldo, int num_threads)
{
    const int64_t nb = k / QK;
    const int kquant = quant_k_block_bytes(qtype) > 0;
    if (!block_bytes(qtype) && !kquant) return 1;
    if (kquant && k % QK_K) return 1;
    const q8a_block *x = (const q8a_block *)xq, *x2 = x + m * nb;
    const int two = passes > 1;
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    #pragma omp parallel for num_threads(num_threads) schedule(static) \
        if (tasks > 1 && m * n * nb >= PARALLEL_MIN_BLOCKS)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t j1 = (t + 1) * ROWS_PER_TASK < n ? (t + 1) * ROWS_PER_TASK : n;
        for (int64_t r = 0; r < m; r++) {
            const q8a_block *xr = x + r * nb, *x2r = x2 + r * nb;
            int64_t j = t * ROWS_PER_TASK;
            if (kquant) {
                for (; j < j1; j++)
                    out[r * ldo + j] = quant_k_row_dot(qtype, w + j * ldw, xr, two ? x2r : 0, k) +
                                       (bias ? bias[j] : 0.f);
                continue;
            }
            for (; j + 4 <= j1; j += 4) {
                float dots[4];
                if (two)
                    rows4_dot_impl(qtype, w + j * ldw, ldw, xr, x2r, nb, 1, dots);
                else
                    rows4_dot_impl(qtype, w + j * ldw, ldw, xr, 0, nb, 0, dots);
                for (int i = 0; i < 4; i++)
                    out[r * ldo + j + i] = dots[i] + (bias ? bias[j + i] : 0.f);
            }
            for (; j < j1; j++) {
                const uint8_t *row = w + j * ldw;
                const float dot = two ? row_dot_impl(qtype, row, xr, x2r, nb, 1)
                                      : row_dot_impl(qtype, row, xr, 0, nb, 0);
                out[r * ldo + j] = dot + (bias ? bias[j] : 0.f);
            }
        }
    }
    return 0;
}

/* Rows ids[i] (i < count) of W (n rows of k / 32 qtype blocks, ldw bytes apart) dequantized
 * to float32 out [count, k] (ldo apart): the embedding lookup of a quantized embedding. Returns
 * 0, 1 for an unknown type, 2 for an id outside [0, n) (its row is left as it was). */
int conveyor_quant_rows_f32(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                            const int64_t *ids, int64_t count, float *out, int64_t ldo)
{
    const int64_t nb = k / QK;
    const int kquant = quant_k_block_bytes(qtype) > 0 && k % QK_K == 0;
    int failed = block_bytes(qtype) || kquant ? 0 : 1;
    for (int64_t i = 0; i < count && !failed; i++) {
        if (ids[i] < 0 || ids[i] >= n) {
            failed = 2;
            continue;
        }
        const uint8_t *row = w + ids[i] * ldw;
        float *o = out + i * ldo;
        if (kquant) {
            quant_k_row_dequantize(qtype, row, k, o);
            continue;
        }
        for (int64_t b = 0; b < nb; b++, o += QK) {
            if (qtype == Q8_0) {
                const q8_0_block *blk = (const q8_0_block *)row + b;
                const float d = half_to_float(blk->d);
                for (int j = 0; j < QK; j++) o[j] = d * blk->q[j];
            } else if (qtype == Q4_1) {
                const q4_1_block *blk = (const q4_1_block *)row + b;
                const float d = half_to_float(blk->d), mn = half_to_float(blk->m);
                for (int j = 0; j < QK; j++) o[j] = d * nibble(blk->qs, j) + mn;
            } else {
                const q4_0_block *blk = (const q4_0_block *)row + b;
                const float d = half_to_float(blk->d);
                for (int j = 0; j < QK; j++) o[j] = d * (nibble(blk->qs, j) - 8);
            }
        }
    }
    return failed;
}

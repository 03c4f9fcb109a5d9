/* What the GGUF block kernels share (quant_linear.c: the 32-weight types; quant_k.c: the
 * 256-weight K-quants): the activation blocks, float16 scales and the integer dot. */
#ifndef CONVEYOR_QUANT_BLOCKS_H
#define CONVEYOR_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "vec_math.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

#define QK 32    /* weights per activation block (and per Q8_0 / Q4_0 / Q4_1 block) */
#define QK_K 256 /* weights per K-quant super-block */

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 }; /* GGML's type ids */

typedef struct {
    float d, s; /* scale, and d * sum(q) */
    int8_t q[QK];
} q8a_block; /* 40 bytes: one block of 32 activations */

_Static_assert(sizeof(q8a_block) == 40, "q8a_block layout");

/* IEEE half to float (normal, subnormal, inf and NaN), for builds without F16C. */
static inline float half_to_float_soft(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant) { /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400)) mant <<= 1, exp--;
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float half_to_float(uint16_t h)
{
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return half_to_float_soft(h);
#endif
}

#ifdef CONVEYOR_AVX2

/* acc plus eight int32 sums, lane i over bytes 4i..4i+3 of u (unsigned) times s (signed):
 * VNNI's dpbusd, or maddubs (int16 pairs) and madd. */
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* Activation quants 4 g .. 4 g + 3 in every lane. */
static inline __m256i quad(const int8_t *q, int g)
{
    int32_t v;
    memcpy(&v, q + 4 * g, 4);
    return _mm256_set1_epi32(v);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CONVEYOR_AVX512 1

/* The 512-bit forms, for two 32-byte quad runs of an interleaved group loaded at once (runs
 * g and g + 1: lanes 0-7 hold run g's eight rows, lanes 8-15 run g + 1's). dpbusd where the
 * build has AVX-512 VNNI, else AVX-512BW's maddubs + madd: the same integer sums. */
static inline __m512i dot_acc512(__m512i acc, __m512i u, __m512i s)
{
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                   _mm512_set1_epi16(1)));
#endif
}

/* A block's 32 activation quants in the low half of a register (the upper half unused). */
static inline __m512i quads512(const int8_t *q)
{
    return _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q));
}

/* Activation quants 4 g .. 4 g + 3 in lanes 0-7 and 4 g + 4 .. 4 g + 7 in lanes 8-15, from
 * quads512's register: the two runs' activations side by side, as the weights are. */
static inline __m512i quad2(__m512i qx, int g)
{
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32(g)), qx);
}

/* The eight rows' sums: lanes i and i + 8 added. */
static inline __m256i halves_sum(__m512i v)
{
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

#endif

#endif

/* quant_x8.c: bytes per block of an interleaved group of eight rows (0: not such a type);
 * the group's eight dot products with one activation row; row r (< 8) of a group dequantized. */
int64_t quant_x8_block_bytes(int qtype);
void quant_x8_group_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                        const q8a_block *x2, float *out);
void quant_x8_row_dequantize(int qtype, const uint8_t *w, int r, int64_t k, float *out);

/* quant_k.c, the same for the K-quants (bytes per super-block of an interleaved group). */
int64_t quant_k_block_bytes(int qtype);
void quant_k_group_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                       const q8a_block *x2, float *out);
void quant_k_row_dequantize(int qtype, const uint8_t *w, int r, int64_t k, float *out);

#endif

/* What the GGUF block kernels share (quant_x8.c: the 32-weight types; quant_k.c: the
 * 256-weight K-quants; quant_linear.c calls them): the activation blocks, the row groups,
 * float16 scales and the integer dot. */
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
/* Weight rows per interleaved group (quant_linear.py's interleave_groups): one 512-bit
 * register holds four consecutive quants of each of the sixteen rows, one int32 lane a row. */
#define QG 16
/* Activation rows per tile: the most rows of x one pass over a group's unpacked weights
 * serves (quant_x8.c and quant_k.c's tile kernels take 1 .. QT). */
#define QT 4

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

/* Activation quants 4 g .. 4 g + 3 in every lane (the AVX2 paths). */
static inline __m256i quad(const int8_t *q, int g)
{
    int32_t v;
    memcpy(&v, q + 4 * g, 4);
    return _mm256_set1_epi32(v);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CONVEYOR_AVX512 1

/* The 512-bit forms, for a quad run of a whole group loaded at once (lane i: row i's four
 * quants). dpbusd where the build has AVX-512 VNNI, else AVX-512BW's maddubs + madd: the
 * same integer sums. */
static inline __m512i dot_acc512(__m512i acc, __m512i u, __m512i s)
{
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                   _mm512_set1_epi16(1)));
#endif
}

/* Activation quants q[0..3] in every lane (the broadcast folds into dpbusd's memory operand). */
static inline __m512i bcast4(const int8_t *q)
{
    int32_t v;
    memcpy(&v, q, 4);
    return _mm512_set1_epi32(v);
}

/* Software prefetch of the weights PREFETCH_AHEAD bytes ahead: the kernels visit a block's
 * lines in `slots` steps (its loads of quants), and at step `slot` prefetch line slot (and
 * slot + slots, ...) of the block that far ahead, so every line of it is asked for once,
 * spread between the loads. One activation row streams the weights faster than the
 * hardware prefetchers fetch them (docs/kernels.md#measured-choices);
 * with a tile of rows the kernels are compute-bound and it costs next to nothing. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 8192
#endif
static inline void prefetch_slot(const uint8_t *block, int64_t bytes, int slot, int slots)
{
    for (int64_t l = slot; 64 * l < bytes; l += slots)
        _mm_prefetch((const char *)(block + PREFETCH_AHEAD + 64 * l), _MM_HINT_T0);
}

/* Sixteen float16 scales at p, and sixteen bytes (signed or not) as floats. */
static inline __m512 halves16(const uint8_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline __m512 bytes16(const uint8_t *p, int is_signed)
{
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw));
}

#ifdef __AVX512BF16__
#define CONVEYOR_QUANT_PANELS 1
/* Four columns of a group's sixteen rows as bf16 (quant_gemm.c's panels): byte b of each
 * int32 lane of q (row i's lane i) less `off`, times scale less mn, is row i's weight in
 * column b; columns 0, 1 go to pair[0 .. 32), 2, 3 to pair[32 .. 64) (each 32-bit word one
 * row's pair, the even column in its low half), rounded to nearest even. */
static inline void panel_columns4(__m512i q, int off, __m512 scale, __m512 mn, uint16_t *pair)
{
    const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                         1, 16, 0);
    const __m512i low = _mm512_set1_epi32(0xFF), shift = _mm512_set1_epi32(off);
    __m512 f[4];
    for (int b = 0; b < 4; b++) {
        const __m512i v = _mm512_and_si512(_mm512_srli_epi32(q, 8 * b), low);
        f[b] = _mm512_fmsub_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(v, shift)), mn);
    }
    _mm512_storeu_si512(pair,
                        _mm512_permutexvar_epi16(zip, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0])));
    _mm512_storeu_si512(pair + 32,
                        _mm512_permutexvar_epi16(zip, (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2])));
}
#endif

#endif

#endif

/* quant_x8.c: bytes per block of an interleaved group of QG rows (0: not such a type); a
 * group's QG dot products with `rows` (1 .. QT) activation rows, ldx blocks apart (x2: their
 * second pass, or NULL; xsum: the activation sums below, NULL for other types),
 * out[r * QG + i] for activation row r and weight row i; row
 * r (< QG) of a group dequantized. */
int64_t quant_x8_block_bytes(int qtype);
void quant_x8_tile_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                       const q8a_block *x2, int64_t ldx, int rows, const int32_t *xsum,
                       float *out);
void quant_x8_row_dequantize(int qtype, const uint8_t *w, int r, int64_t k, float *out);

/* quant_k.c, the same for the K-quants (bytes per super-block of an interleaved group). */
int64_t quant_k_block_bytes(int qtype);
void quant_k_tile_dot(int qtype, const uint8_t *w, int64_t k, const q8a_block *x,
                      const q8a_block *x2, int64_t ldx, int rows, const int32_t *xsum,
                      float *out);
void quant_k_row_dequantize(int qtype, const uint8_t *w, int r, int64_t k, float *out);

/* Whether these files handle type qtype at width k (whole blocks, whole super-blocks for the
 * K-quants): the one check of every entry point. */
static inline int quant_type_fits(int qtype, int64_t k)
{
    if (quant_k_block_bytes(qtype) > 0) return k % QK_K == 0;
    return quant_x8_block_bytes(qtype) > 0 && k % QK == 0;
}

/* With AVX512-BF16 (CONVEYOR_QUANT_PANELS): a group's sixteen rows, k weights each, as one
 * bf16 panel [k / 2][16][2] (linear.c's layout; quant_gemm.c), the weights those of
 * *_row_dequantize rounded to nearest even. */
void quant_x8_group_panel(int qtype, const uint8_t *w, int64_t k, uint16_t *panel);
void quant_k_group_panel(int qtype, const uint8_t *w, int64_t k, uint16_t *panel);

/* The activation sums the kernels' dpbusd paths start their integer sums from (xsum:
 * int32 [passes][m][k / 32][2], conveyor_quant_linear_f32 fills them for these two types):
 * Q6_K -32 times each half-block's sum of 16 quants (its q - 32 offset), Q8_0 -128 times the
 * block's sum of 32 (its weights are stored + 128, unsigned for dpbusd) and 0. */

#endif

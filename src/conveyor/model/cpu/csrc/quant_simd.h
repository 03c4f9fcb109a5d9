/* Inline helpers of the GGUF block kernels (quant_x8_*.c, quant_k_*.c, quant_linear.c):
 * float16 and E8M0 scales, MXFP4's values, the integer dot of unsigned and signed bytes,
 * broadcasts of activation quants, the weights' software prefetch and the bf16 panel
 * columns. */
#ifndef CONVEYOR_QUANT_SIMD_H
#define CONVEYOR_QUANT_SIMD_H

#include <stdint.h>
#include <string.h>

#include "kernels.h"
#if defined(__F16C__) || defined(CONVEYOR_AVX2)
#include <immintrin.h>
#endif

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

/* MXFP4's sixteen E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated) doubled,
 * as GGUF holds them: integers, so a block's dot product is an integer one; its scale is
 * halved to match (e8m0_half). */
#define MXFP4_VALUES 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12

static inline int mxfp4_value(int nibble)
{
    static const int8_t values[16] = {MXFP4_VALUES};
    return values[nibble & 15];
}

/* An E8M0 scale byte e (the float 2^(e - 127)) halved: the bits of 2^(e - 128), a subnormal
 * for e < 2 (GGUF's decoding, ggml_e8m0_to_fp32_half; e = 255 is 2^127, no NaN). */
static inline float e8m0_half(uint8_t e)
{
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
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

/* Eight float16 scales at p, and eight bytes (signed or not) as floats (the AVX2 paths). */
#ifdef __F16C__
static inline __m256 halves8(const uint8_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#endif

static inline __m256 bytes8(const uint8_t *p, int is_signed)
{
    const __m128i raw = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
}

/* Eight E8M0 scale bytes at p as e8m0_half's floats. */
static inline __m256 e8m0_halves8(const uint8_t *p)
{
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i is_tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, is_tiny));
}

/* MXFP4's values plus MXFP4_OFFSET (0 .. 24: unsigned, as dpbusd and maddubs take weights,
 * and small enough that maddubs never saturates) as the byte table of a nibble lookup
 * (shuffle_epi8) in each 128-bit lane; the dot products' sums start from -12 sum(qx)
 * (XSUM_MXFP4) to take the offset off. */
#define MXFP4_OFFSET 12
static inline __m128i mxfp4_table(void)
{
    return _mm_add_epi8(_mm_setr_epi8(MXFP4_VALUES), _mm_set1_epi8(MXFP4_OFFSET));
}

/* Activation quants 4 g .. 4 g + 3 in every lane (the AVX2 paths). */
static inline __m256i quad(const int8_t *q, int g)
{
    int32_t v;
    memcpy(&v, q + 4 * g, 4);
    return _mm256_set1_epi32(v);
}

#ifdef CONVEYOR_AVX512

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

/* Sixteen E8M0 scale bytes at p as e8m0_half's floats. */
static inline __m512 e8m0_halves16(const uint8_t *p)
{
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 is_tiny = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_tiny, normal, tiny));
}

static inline __m512 bytes16(const uint8_t *p, int is_signed)
{
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw));
}

#ifdef CONVEYOR_QUANT_PANELS
/* Four columns of a group's sixteen rows as bf16 (the panel functions'): byte b of each
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

#endif

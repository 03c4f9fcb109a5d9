/* The GGUF weights as the kernels read them: interleaved QG = 16 rows at a time at load
 * (quant_linear.py's interleave_groups; the bytes are the file's, reordered). A weight whose
 * row count is not a multiple of 16 is padded with zero rows (d = 0).
 *
 * The 32-weight types (quant_x8_*.c), group of rows 16G .. 16G + 15, block b (weights
 * 32 b .. 32 b + 31 of each row):
 *
 *     Q4_0  d[16]               q[4][16][4]    288 bytes
 *     Q4_1  d[16], m[16]        q[4][16][4]    320 bytes
 *     Q8_0  d[16]               q[8][16][4]    544 bytes
 *     MXFP4 e[16]               q[4][16][4]    272 bytes
 *
 * d and m float16, one per row; q[g][r][i] is the file's quant byte 4 g + i of row r's block:
 * for Q4 and MXFP4 the byte holding weights 4 g + i (low nibble) and 16 + 4 g + i (high
 * nibble), for Q8_0 weight 4 g + i plus 128 (stored unsigned: dpbusd multiplies unsigned
 * weights by signed activations without saturating, and the block's 128 sum(qx) comes off).
 * MXFP4 (GGUF's block: e, qs[16], 17 bytes; an HF gpt-oss checkpoint's experts are repacked
 * into it at load): e is the block's E8M0 scale byte, one per row, and a nibble indexes the
 * sixteen E2M1 values doubled (integers, mxfp4_value), so w = 2^(e - 128) value. So one
 * 64-byte load holds four consecutive quants of each of the sixteen rows, and one `dpbusd`
 * (or `maddubs` + `madd`) against four activation quants broadcast to every lane adds them
 * into sixteen int32 sums, one lane per row: a block's sixteen dot products without a
 * horizontal sum, and the sixteen scales convert in one instruction.
 *
 * The K-quants (quant_k_*.c). In the file a super-block holds 256 weights of one row
 * (little-endian, d and dmin float16):
 *
 *     Q4_K  d, dmin, scales[12], qs[128]           144 bytes
 *     Q5_K  d, dmin, scales[12], qh[32], qs[128]   176 bytes
 *     Q6_K  ql[128], qh[64], int8 sc[16], d        210 bytes
 *
 * Q4_K and Q5_K: eight sub-blocks of 32, each with a 6-bit scale s_j and a 6-bit minimum
 * m_j packed into `scales`; w = (d s_j) q - (dmin m_j), q in 0..15 (Q4_K) or 0..31 (Q5_K).
 * Sub-blocks 2c and 2c + 1 share qs[32c .. 32c + 32): the low nibbles are 2c's, the high
 * ones 2c + 1's; Q5_K's fifth bit of weight l of sub-block j is bit j of qh[l].
 *
 * Q6_K: sixteen sub-blocks of 16 with int8 scales; w = (d sc_i) (q - 32), q in 0..63 from a
 * nibble of ql and two bits of qh. In each half h of 128 weights (ql + 64 h, qh + 32 h,
 * sc + 8 h), weight 32 b + l (b < 4, l < 32) is
 *
 *     b = 0: ql[l] & 15       | (qh[l] >> 0 & 3) << 4        scale sc[2b + l / 16]
 *     b = 1: ql[l + 32] & 15  | (qh[l] >> 2 & 3) << 4
 *     b = 2: ql[l] >> 4       | (qh[l] >> 4 & 3) << 4
 *     b = 3: ql[l + 32] >> 4  | (qh[l] >> 6 & 3) << 4
 *
 * Interleaved, per group of sixteen rows and super-block ("quads": a 32-byte run of each row
 * stored as q[8][16 rows][4], four bytes of each row side by side, as above):
 *
 *     Q4_K  d[16], dmin[16], sc[8][16], m[8][16], qs: 4 runs as quads     2368 bytes
 *     Q5_K  d[16], dmin[16], sc[8][16], m[8][16], qh quads, qs quads      2880 bytes
 *     Q6_K  d[16], int8 sc[16][16], ql: 4 runs as quads, qh: 2 runs       3360 bytes
 *
 * with the 6-bit scales and minimums decoded to bytes ([sub-block][row]; 2-3% more than the
 * file for Q4_K and Q5_K, Q6_K the same size).
 */
#ifndef CONVEYOR_QUANT_LAYOUT_H
#define CONVEYOR_QUANT_LAYOUT_H

#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "quant_simd.h"

/* Bytes per block of an interleaved group (quant_types.c's table holds them too). */
#define Q4_0_GROUP_BYTES 288
#define Q4_1_GROUP_BYTES 320
#define Q8_0_GROUP_BYTES 544
#define MXFP4_GROUP_BYTES 272
#define Q4_K_GROUP_BYTES 2368
#define Q5_K_GROUP_BYTES 2880
#define Q6_K_GROUP_BYTES 3360

/* The same by type, for kernels written once for several types: static inline, so a
 * constant type folds it to a constant even in -fPIC code. */
static inline int64_t x8_block_bytes(int qtype)
{
    switch (qtype) {
    case Q4_0: return Q4_0_GROUP_BYTES;
    case Q4_1: return Q4_1_GROUP_BYTES;
    case Q8_0: return Q8_0_GROUP_BYTES;
    case MXFP4: return MXFP4_GROUP_BYTES;
    default: return 0;
    }
}

static inline int64_t k_block_bytes(int qtype)
{
    switch (qtype) {
    case Q4_K: return Q4_K_GROUP_BYTES;
    case Q5_K: return Q5_K_GROUP_BYTES;
    case Q6_K: return Q6_K_GROUP_BYTES;
    default: return 0;
    }
}

/* The two families of types, each written once in its files (quant_entries.h): X(t, TYPE)
 * per type, t the entry points' name for it. */
#define X8_TYPES(X) X(q8_0, Q8_0) X(q4_0, Q4_0) X(q4_1, Q4_1) X(mxfp4, MXFP4) /* quant_x8_*.c */
#define K_TYPES(X) X(q4_k, Q4_K) X(q5_k, Q5_K) X(q6_k, Q6_K)                   /* quant_k_*.c */

/* The 32-weight types: bytes of scales before the quants. */
static inline int header_bytes(int qtype)
{
    return qtype == Q4_1 ? 4 * QG : qtype == MXFP4 ? QG : 2 * QG;
}

/* Offsets in an interleaved K-quant super-block of sixteen rows; a quad run is 8 x 64 bytes. */
enum { K_SC = 64, K_MIN = 192, K_QH = 320 };           /* Q4_K / Q5_K (qs at 320, or 832) */
enum { Q6_SC = 32, Q6_QL = 288, Q6_QH = 288 + 2048 }; /* Q6_K */
enum { RUN = 8 * 4 * QG };                             /* bytes of a 32-byte run as quads */

static inline int k_qs(int qtype) { return qtype == Q5_K ? K_QH + RUN : K_QH; }

/* Byte j (< 32) of row r's 32-byte run stored as quads at p. */
static inline uint8_t quad_byte(const uint8_t *p, int r, int j)
{
    return p[4 * QG * (j / 4) + 4 * r + j % 4];
}

/* Row r's float16 at p (one per row, side by side). */
static inline float half_at(const uint8_t *p, int r)
{
    uint16_t h;
    memcpy(&h, p + 2 * r, 2);
    return half_to_float(h);
}

#endif

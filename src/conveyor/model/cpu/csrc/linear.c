/* Linear layers for CPU: out = x @ W^T + bias, x, bias and out float32, with W [N, K] packed
 * once at load into panels of NR = 16 output columns (the last panel zero-padded;
 * conveyor.model.cpu.linear.CpuLinear packs them), a panel a run of 64-byte lines: float32,
 * a line one k's 16 weights (conveyor_linear_f32), or bfloat16, a line one pair of k's 16
 * pairs [16][2] (conveyor_linear_bf16: half the bytes to stream). The panels are stored four
 * to a group, line by line (PANEL_GROUP below). linear_gemm.h is the kernel, once per
 * weight type; the build picks one of four paths by what the compiler may use (-march=native:
 * this CPU's features; CONVEYOR_CPU_ISA forces a lower one), and conveyor_linear_isa says
 * which:
 *
 *   AVX2 + FMA   a 6 x 16 block of out in twelve ymm registers; for each k the panel's 16
 *                weights are loaded once (two vectors) and one x value per row broadcast: 12
 *                FMAs for 8 loads, the classic shape for 16 vector registers; for 1-3 rows
 *                (decode) one row by a group's four panels at a time instead. bf16 weights
 *                are widened to float32 in registers (the same float32 products and sums).
 *   AVX-512      16 columns are one zmm: up to 16 rows x 16 columns of accumulators, x's
 *                block of rows packed first (pack_rows) so the values broadcast for one k
 *                share a cache line; for 1-16 rows (decode) four panels per call, four
 *                rows at a time, so a step is not bound by one FMA chain's latency per k.
 *                bf16 widened as above.
 *   AVX512-BF16  bf16 weights through vdpbf16ps: x rounded to bf16 (nearest even) once per
 *                block of rows, each instruction two k per lane; the same blocking. This
 *                changes bf16 mode's numerics (x rounded, as oneDNN's and vLLM-CPU's bf16
 *                linears do); float32 weights are untouched. The widening kernel stays
 *                callable (conveyor_linear_bf16_widened).
 *   portable     a plain C loop over the same panels (no AVX2: CONVEYOR_CPU_ISA=portable, an
 *                older x86-64, aarch64).
 *
 * Each output is one sum over k in order (bias first; pairs of k in order with vdpbf16ps),
 * so a row's result does not depend on the batch it is in, and float32 weights give the
 * same bits on the AVX2 and AVX-512 paths (the same FMAs in the same order).
 *
 * Blocking: rows in blocks of MC (x's block stays in L2 while every panel passes over it),
 * K in blocks of KC (a panel's block of 16 x KC weights stays in L1/L2 while the row blocks
 * reuse it; the partial sums wait in out). Threads split the panels. The first row block of
 * each panel prefetches the weights ahead of it: at decode batch sizes (a few to a few dozen
 * rows) the weights stream from DRAM once per step and this is what bounds a step; a thread
 * reads a group of four panels as one stream.
 * benchmarks/linear_bf16.py measures each path against oneDNN and torch (docs/benchmarks.md).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

/* The kernel this build has, by what the compiler may use (-march=native: this CPU's):
 * AVX-512F (zmm accumulators for either weight type), AVX512-BF16 on top of it (bf16 panels
 * through vdpbf16ps, x rounded to bf16), AVX2 + FMA, or the portable loop. */
#if defined(CONVEYOR_AVX2) && defined(__AVX512F__)
#define CONVEYOR_GEMM512 1
#if defined(__AVX512BF16__)
#define CONVEYOR_DPBF16 1
#endif
#endif

#define NR 16
/* Panels are stored in groups of PANEL_GROUP side by side, line by line (a line: one k's 16
 * float32, or one pair of k's 16 bf16 pairs; 64 bytes either way): the group's line 0 of each
 * panel, then line 1 of each, ... (the last group has the panels left over). A decode step,
 * which takes a group's panels together (WIDE_P, the same four), so reads the weights as one
 * stream per thread. Four streams per thread, one per panel, read 12-25 % slower on this
 * VM's EPYC (docs/kernels.md#measured-choices). quant_gemm.c's slices are panels one to a
 * group (conveyor_linear_bf16_grouped). */
#define PANEL_GROUP 4

/* bf16 panels for vdpbf16ps (`split`): with an odd number of whole groups of PANEL_GROUP,
 * the middle one is stored as two groups of half as many panels (each half's lines side by
 * side, the first half's before the second's). A decode step's two threads split the groups
 * by halves (few_rows_dp), so each one's share is then one stream; interleaved in one group,
 * the half a thread read first pulled much of the other half through the prefetchers, and
 * SmolLM2's o and down (nine groups) took one thread ~10 % longer than the other
 * (docs/kernels.md#measured-choices). CpuLinear packs them so (linear.py's group_panels)
 * where this build has vdpbf16ps; float32 panels, and the AVX2 and widening builds (which
 * take a group whole or panels one at a time), keep every group whole. */
#if defined(CONVEYOR_DPBF16)
#define SPLIT_BF16 1
#else
#define SPLIT_BF16 0
#endif
static inline int split_group(int64_t g, int64_t panels, int group, int split)
{
    const int64_t whole = panels / group;
    return split && group == PANEL_GROUP && whole % 2 == 1 && g == whole / 2;
}

/* The line index of panel p's first line, `lines` lines a panel, `panels` of them, and the
 * lines between two of its consecutive lines (the panels in its group, or half-group). */
static inline int64_t panel_line0(int64_t p, int64_t lines, int64_t panels, int group, int split)
{
    const int64_t g = p / group, first = g * group * lines;
    if (split_group(g, panels, group, split)) {
        const int half = group / 2;
        return first + (p % group) / half * half * lines + p % half;
    }
    return first + p % group;
}
static inline int64_t panel_qs(int64_t p, int64_t panels, int group, int split)
{
    if (split_group(p / group, panels, group, split)) return group / 2;
    const int64_t rest = panels - (p / group) * group;
    return rest < group ? rest : group;
}
#define KC 256 /* a panel's block: 16 KiB of float32 (or of bf16 pairs in vdpbf16ps's loop) */
#define PARALLEL_MIN_FLOPS (1 << 16)
/* Whether a GEMM is worth a team of threads: more than one panel, and enough flops. */
static inline int worth_a_team(int64_t m, int64_t n, int64_t k)
{
    return n > NR && 2 * m * n * k >= PARALLEL_MIN_FLOPS;
}
#define PACK_PARALLEL_MIN (1 << 15) /* x's values rounded and spread by every thread */
#define OWN_PACK_WORDS 8192 /* x packed by each thread on its own stack (32 KiB): a decode step */

#if defined(CONVEYOR_GEMM512)
/* 32 zmm registers: MR accumulators, the panel's zmm and the broadcast x. */
#define MR 16
#define MC 288 /* a multiple of MR: 288 x 256 floats of x, 288 KiB */
#define PREFETCH_LINES 32 /* ahead in the panel's own lines (2 KiB of them; 16 read 2-5 % slower) */
#define MICROS_ALL                                                                             \
    MICRO(16) MICRO(15) MICRO(14) MICRO(13) MICRO(12) MICRO(11) MICRO(10) MICRO(9) MICRO(8)   \
        MICRO(7) MICRO(6) MICRO(5) MICRO(4) MICRO(3) MICRO(2) MICRO(1)
#define MICROS_LIST                                                                            \
    0, MICRO_FN(1), MICRO_FN(2), MICRO_FN(3), MICRO_FN(4), MICRO_FN(5), MICRO_FN(6),          \
        MICRO_FN(7), MICRO_FN(8), MICRO_FN(9), MICRO_FN(10), MICRO_FN(11), MICRO_FN(12),      \
        MICRO_FN(13), MICRO_FN(14), MICRO_FN(15), MICRO_FN(16)
/* A few rows (at most WIDE_R): WIDE_P panels per micro-kernel call. */
#define WIDE_R 4
#define WIDE_P 4 /* PANEL_GROUP: a decode step takes a group at a time */
#define HALF_P 2 /* or half of one (linear.c's few_rows_dp) */
/* 5-16 rows (a decode step of that many sequences) take the same kernels four rows at a time
 * over each block of four panels, the later rows re-reading the panels' block from L1: one
 * panel at a time left a step of 8 rows 1.4x as long as one of 4 (eight dependency chains
 * too few to keep the weights streaming) and 16 rows bound by their loads (a broadcast and a
 * weight load for each 16 x 1 instruction's worth) (docs/kernels.md#measured-choices). */
#define WIDE2_R 16
#define WIDES_ALL WIDE(4) WIDE(3) WIDE(2) WIDE(1)
#define WIDES_LIST 0, WIDE_FN(1), WIDE_FN(2), WIDE_FN(3), WIDE_FN(4)

/* The calling thread's buffer for x packed for the micro-kernels, grown as needed and kept
 * (NULL when it cannot grow: the callers then pack per micro-kernel call, on the stack). */
static _Thread_local void *pack_buf;
static _Thread_local size_t pack_cap;

static void *pack_buffer(size_t bytes)
{
    if (bytes > pack_cap) {
        void *grown = realloc(pack_buf, bytes);
        if (!grown) return 0;
        pack_buf = grown, pack_cap = bytes;
    }
    return pack_buf;
}

/* Rows [0, mb) of x (k columns) packed by blocks of xs rows (MR, or a few rows' count; out
 * holds mb rounded up to xs rows), block b at out + b xs k and its row r's column kk at
 * [kk xs + r]: the values a micro-kernel broadcasts for one k sit in one cache line, wherever
 * x's rows are (rows a power-of-two stride apart would all fall in one L1 set), and a single
 * row's k are contiguous, not a line each (which the other threads would pull one by one). */
static void pack_rows(const float *x, int64_t ldx, int64_t mb, int64_t k, float *out,
                      int64_t xs)
{
    for (int64_t r = 0; r < mb; r++) {
        float *blk = out + (r / xs) * xs * k + r % xs;
        const float *row = x + r * ldx;
        for (int64_t kk = 0; kk < k; kk++) blk[kk * xs] = row[kk];
    }
}
#elif defined(CONVEYOR_AVX2)
#define MR 6
#define MC 288 /* a multiple of MR: 288 x 256 floats of x, 288 KiB */
#define PREFETCH_K 32 /* k steps (64 B of float32 each) ahead (16, 64, 128: level) */
/* A few rows (a decode step of at most WIDE2_R_F32 / WIDE2_R_BF16 sequences) take a group's
 * WIDE_P panels together, one row at a time (8 accumulators: 16 ymm registers hold no second
 * row), the later rows re-reading the group's block from L1/L2: the group streams as one, and
 * the row's sums are eight independent FMA chains, not two waiting on each other's latency
 * per k. From one row more (bf16 widens its weights again for every row) the 6 x 16 blocks
 * are as fast or faster (docs/kernels.md#measured-choices). */
#define WIDE_P 4 /* PANEL_GROUP */
#define WIDE2_R_F32 3
#define WIDE2_R_BF16 2
#define MICROS_ALL MICRO(6) MICRO(5) MICRO(4) MICRO(3) MICRO(2) MICRO(1)
#define MICROS_LIST                                                                            \
    0, MICRO_FN(1), MICRO_FN(2), MICRO_FN(3), MICRO_FN(4), MICRO_FN(5), MICRO_FN(6)
#else
#define PR 4 /* the portable loop's rows per weight load */
#endif

#if defined(CONVEYOR_AVX2) && !defined(CONVEYOR_GEMM512)

static inline __attribute__((always_inline)) void load_row(const float *o, int cols, __m256 *a0,
                                                           __m256 *a1)
{
    if (cols == NR) {
        *a0 = _mm256_loadu_ps(o);
        *a1 = _mm256_loadu_ps(o + 8);
    } else {
        float tmp[NR] = {0};
        memcpy(tmp, o, cols * sizeof(float));
        *a0 = _mm256_loadu_ps(tmp);
        *a1 = _mm256_loadu_ps(tmp + 8);
    }
}

static inline __attribute__((always_inline)) void store_row(float *o, int cols, __m256 a0,
                                                            __m256 a1)
{
    if (cols == NR) {
        _mm256_storeu_ps(o, a0);
        _mm256_storeu_ps(o + 8, a1);
    } else {
        float tmp[NR];
        _mm256_storeu_ps(tmp, a0);
        _mm256_storeu_ps(tmp + 8, a1);
        memcpy(o, tmp, cols * sizeof(float));
    }
}

/* Rows r < R of the 6 x 16 block; R is a constant in each instance, so the compiler drops
 * the rest and keeps the accumulators in registers. */
#define ROW_INIT(r)                                                                            \
    if (RR > r) {                                                                              \
        if (first)                                                                             \
            c##r##0 = b0, c##r##1 = b1;                                                        \
        else                                                                                   \
            load_row(o + r * ldo, cols, &c##r##0, &c##r##1);                                   \
    }
#define ROW_FMA(r)                                                                             \
    if (RR > r) {                                                                              \
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + kx);                                \
        c##r##0 = _mm256_fmadd_ps(a, w0, c##r##0);                                             \
        c##r##1 = _mm256_fmadd_ps(a, w1, c##r##1);                                             \
    }
#define ROW_STORE(r)                                                                           \
    if (RR > r) store_row(o + r * ldo, cols, c##r##0, c##r##1);

#endif

/* float32 weights: [panels][K][16] floats. */
#define GEMM_FN conveyor_linear_f32
#define W_T float
#define SUFFIX _f32
#define KSTEP(k) (k)
#define K_PER_LINE 1
#define PREFETCH_ODD 1 /* every k starts a 64-byte line */
#define AHEAD_PREFETCH 1 /* AVX2 blocks: the second row block prefetches the next (kernels.md) */
#define LINE_AT(panel, kk, qs) ((panel) + (kk) * (qs))
#define LOAD_W(panel, kk, odd, qs, w0, w1)                                                     \
    (w0 = _mm256_loadu_ps(LINE_AT(panel, kk, qs)), w1 = _mm256_loadu_ps(LINE_AT(panel, kk, qs) + 8))
#define LOAD_W512(panel, kk, odd, qs) _mm512_loadu_ps(LINE_AT(panel, kk, qs))
#define W_AT(panel, kk, j, qs) (LINE_AT(panel, kk, qs)[j])
#define W_SPLIT 0 /* float32 groups are never split */
#include "linear_gemm.h"
#undef GEMM_FN
#undef W_T
#undef W_SPLIT
#undef SUFFIX
#undef KSTEP
#undef K_PER_LINE
#undef PREFETCH_ODD
#undef AHEAD_PREFETCH
#undef LINE_AT
#undef LOAD_W
#undef LOAD_W512
#undef W_AT

/* bfloat16 weights: [panels][ceil(K / 2)][16][2] uint16, k in pairs (an odd K's last pair
 * padded with a zero), so that the 32-bit word of column j holds k = 2i in its low half and
 * k = 2i + 1 in its high half (CpuLinear packs them so). That is the operand vdpbf16ps takes;
 * widened, a bf16 is the top half of its float32, so one load of a pair's words gives both
 * k in one integer operation each: a shift left by 16 (even k) or a mask of the high halves
 * (odd k; AVX2 clears the low halves with two shifts instead). Widened, the products and sums
 * are float32, as with float32 weights. */
static inline float bf16_at(const uint16_t *line, int64_t kk, int j)
{
    const uint32_t bits = (uint32_t)line[2 * j + (kk & 1)] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#define W_T uint16_t
#define SUFFIX _bf16
#define KSTEP(k) ((k) + ((k) & 1))
#define K_PER_LINE 2
#define PREFETCH_ODD 0 /* a pair of k is one 64-byte line */
#define AHEAD_PREFETCH 0 /* bf16 measured 0.85-1.18x, no steady gain (kernels.md) */
#define LINE_AT(panel, kk, qs) ((panel) + ((kk) >> 1) * (qs))
#define LOAD_W(panel, kk, odd, qs, w0, w1)                                                     \
    do {                                                                                       \
        const __m256i *p_ = (const __m256i *)LINE_AT(panel, kk, qs);                           \
        const __m256i v0_ = _mm256_loadu_si256(p_), v1_ = _mm256_loadu_si256(p_ + 1);          \
        /* odd: the high halves, by two shifts: a mask would take a 16th ymm, and the 6 x 16  \
         * block then spills an accumulator every k (docs/kernels.md#measured-choices) */      \
        w0 = _mm256_castsi256_ps(_mm256_slli_epi32(odd ? _mm256_srli_epi32(v0_, 16) : v0_, 16)); \
        w1 = _mm256_castsi256_ps(_mm256_slli_epi32(odd ? _mm256_srli_epi32(v1_, 16) : v1_, 16)); \
    } while (0)
#define LOAD_W512(panel, kk, odd, qs)                                                          \
    _mm512_castsi512_ps(odd ? _mm512_and_si512(_mm512_loadu_si512(LINE_AT(panel, kk, qs)),     \
                                               _mm512_set1_epi32((int)0xFFFF0000u))            \
                            : _mm512_slli_epi32(_mm512_loadu_si512(LINE_AT(panel, kk, qs)), 16))
#define W_AT(panel, kk, j, qs) bf16_at(LINE_AT(panel, kk, qs), kk, j)
/* With vdpbf16ps the widening kernel is a second entry point (benchmarks, tests). */
#if defined(CONVEYOR_DPBF16)
#define GEMM_FN conveyor_linear_bf16_widened
#else
#define GEMM_FN conveyor_linear_bf16
#endif
#define W_SPLIT SPLIT_BF16 /* CpuLinear's layout for this build's bf16 panels */
#include "linear_gemm.h"
#undef GEMM_FN
#undef W_T
#undef W_SPLIT
#undef SUFFIX
#undef KSTEP
#undef K_PER_LINE
#undef PREFETCH_ODD
#undef AHEAD_PREFETCH
#undef LINE_AT
#undef LOAD_W
#undef LOAD_W512
#undef W_AT

#if defined(CONVEYOR_DPBF16)

/* bfloat16 weights through vdpbf16ps: each 32-bit lane of an accumulator takes a pair of k
 * at once, x's pair (both rounded to bf16, nearest even, as vcvtne2ps2bf16 does) times the
 * column's pair, so one instruction does the work of two FMAs. x's rows are rounded once per
 * block of rows into a buffer of pairs (an odd K's last pair padded with a zero, like the
 * panels). The sum per output is bias first, then the pairs in order; the same for a row
 * whatever batch it is in. */

/* x [k] float32 -> ceil(k / 2) words of bf16 pairs. */
static void round_pairs(const float *x, int64_t k, uint32_t *out)
{
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512(out + i / 2, (__m512i)v);
    }
    if (i < k) {
        const int rest = (int)(k - i);
        const __mmask16 lo = rest >= 16 ? 0xFFFF : (__mmask16)((1u << rest) - 1);
        const __mmask16 hi = rest > 16 ? (__mmask16)((1u << (rest - 16)) - 1) : 0;
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + i + 16),
                                               _mm512_maskz_loadu_ps(lo, x + i));
        _mm512_mask_storeu_epi32(out + i / 2, (__mmask16)((1u << ((rest + 1) / 2)) - 1),
                                 (__m512i)v);
    }
}

/* Row x [k] rounded to pairs and spread as the micro-kernels read it: pair q at
 * blk[q xs]. */
static void pack_pairs_row(const float *x, int64_t k, uint32_t *blk, int64_t xs)
{
    uint32_t words[16];
    for (int64_t i = 0; i < k; i += 32) {
        const int64_t len = k - i < 32 ? k - i : 32;
        round_pairs(x + i, len, words);
        for (int64_t q = 0; q < (len + 1) / 2; q++) blk[(i / 2 + q) * xs] = words[q];
    }
}

/* As MICRO_P in linear_gemm.h, on pairs: row r's pair q at xp[q xs + r] (xs MR, as pack_rows
 * packs floats, or for a few rows their count, so that one row's pairs are not a cache line
 * each), the panel's pair q of its 16 columns one 64-byte line, qs uint16 after pair
 * q - 1's. */
#define MICRO_DP(R, P, NAME)                                                                   \
    static void NAME(const uint32_t *xp, int64_t xs, int64_t pstride, const uint16_t *panel,  \
                     int64_t qs,                                                               \
                     int64_t pairs, const float *bias, int first, int prefetch, float *o,      \
                     int64_t ldo, int cols)                                                    \
    {                                                                                          \
        enum { RR = R, PP = P };                                                               \
        __mmask16 mask[PP];                                                                    \
        __m512 c[PP][RR];                                                                      \
        _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++) {                                 \
            mask[j] = j == PP - 1 ? (__mmask16)((1u << cols) - 1) : (__mmask16)0xFFFF;          \
            const __m512 b = first && bias ? _mm512_maskz_loadu_ps(mask[j], bias + j * NR)     \
                                           : _mm512_setzero_ps();                              \
            _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++) c[j][r] =                    \
                first ? b : _mm512_maskz_loadu_ps(mask[j], o + r * ldo + j * NR);              \
        }                                                                                      \
        for (int64_t q = 0; q < pairs; q++) {                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++) {                             \
                const uint16_t *pj = panel + j * pstride + q * qs;                             \
                if (prefetch) _mm_prefetch((const char *)(pj + PREFETCH_LINES * qs), _MM_HINT_T0); \
                const __m512bh w = (__m512bh)_mm512_loadu_si512(pj);                           \
                _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++) c[j][r] =                \
                    _mm512_dpbf16_ps(c[j][r], (__m512bh)_mm512_set1_epi32((int)xp[q * xs + r]), \
                                     w);                                                       \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 4") for (int j = 0; j < PP; j++)                                   \
            _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++)                              \
                _mm512_mask_storeu_ps(o + r * ldo + j * NR, mask[j], c[j][r]);                 \
    }
MICRO_DP(16, 1, micro16_dp)
MICRO_DP(15, 1, micro15_dp)
MICRO_DP(14, 1, micro14_dp)
MICRO_DP(13, 1, micro13_dp)
MICRO_DP(12, 1, micro12_dp)
MICRO_DP(11, 1, micro11_dp)
MICRO_DP(10, 1, micro10_dp)
MICRO_DP(9, 1, micro9_dp)
MICRO_DP(8, 1, micro8_dp)
MICRO_DP(7, 1, micro7_dp)
MICRO_DP(6, 1, micro6_dp)
MICRO_DP(5, 1, micro5_dp)
MICRO_DP(4, 1, micro4_dp)
MICRO_DP(3, 1, micro3_dp)
MICRO_DP(2, 1, micro2_dp)
MICRO_DP(1, 1, micro1_dp)
MICRO_DP(4, WIDE_P, wide4_dp)
MICRO_DP(3, WIDE_P, wide3_dp)
MICRO_DP(2, WIDE_P, wide2_dp)
MICRO_DP(1, WIDE_P, wide1_dp)
MICRO_DP(4, HALF_P, half4_dp)
MICRO_DP(3, HALF_P, half3_dp)
MICRO_DP(2, HALF_P, half2_dp)
MICRO_DP(1, HALF_P, half1_dp)
#undef MICRO_DP

/* Long x (prefill): TR rows x TP panels of accumulators (24 zmm), each k pair's TP weight
 * vectors loaded once and each row's pair broadcast once into a register, then used TP
 * times: 11 loads for 24 vdpbf16ps where the 16 x 1 micro-kernel issues 17 loads for 16 (a
 * broadcast from memory is a load, so that kernel is bound by its loads). Each output's sum
 * is the same as in the micro-kernels (bias first, then the pairs in order): a row's result
 * does not depend on the path its batch takes. xp as micros_dp take it (rows MR apart). */
#define TR 8
#define TP 3
#define TQ 128 /* pairs per block: TP panels x 128 pairs x 64 B = 24 KiB, in L1 with x's */
/* From this many rows (a prefill chunk); a decode step's few rows stream the weights from
 * memory, where the micro-kernels' prefetching 16 x 1 blocks are as fast or faster
 * (docs/kernels.md#measured-choices). */
#define TILE_MIN_ROWS 64
static void tile_dp(const uint32_t *xp, const uint16_t *const panel[TP], const int64_t qs[TP],
                    int64_t pairs, const float *bias, int first, float *o, int64_t ldo, int rows)
{
    __m512 c[TR][TP];
    for (int j = 0; j < TP; j++) {
        const __m512 b = first && bias ? _mm512_loadu_ps(bias + j * NR) : _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (int r = 0; r < TR; r++) c[r][j] =
            first ? b : _mm512_loadu_ps(o + r * ldo + j * NR);
    }
    for (int64_t q = 0; q < pairs; q++) {
        __m512bh w[TP];
        _Pragma("GCC unroll 3") for (int j = 0; j < TP; j++) w[j] =
            (__m512bh)_mm512_loadu_si512(panel[j] + q * qs[j]);
        _Pragma("GCC unroll 8") for (int r = 0; r < TR; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xp[q * MR + r]);
            _Pragma("GCC unroll 3") for (int j = 0; j < TP; j++) c[r][j] =
                _mm512_dpbf16_ps(c[r][j], a, w[j]);
        }
    }
    for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 3") for (int j = 0; j < TP; j++)
            _mm512_storeu_ps(o + r * ldo + j * NR, c[r][j]);
}

typedef void (*micro_dp_fn)(const uint32_t *, int64_t, int64_t, const uint16_t *, int64_t,
                            int64_t, const float *, int, int, float *, int64_t, int);
static const micro_dp_fn micros_dp[MR + 1] = {
    0,          micro1_dp,  micro2_dp,  micro3_dp,  micro4_dp,  micro5_dp,
    micro6_dp,  micro7_dp,  micro8_dp,  micro9_dp,  micro10_dp, micro11_dp,
    micro12_dp, micro13_dp, micro14_dp, micro15_dp, micro16_dp};
static const micro_dp_fn wides_dp[WIDE_R + 1] = {0, wide1_dp, wide2_dp, wide3_dp, wide4_dp};
static const micro_dp_fn halves_dp[WIDE_R + 1] = {0, half1_dp, half2_dp, half3_dp, half4_dp};

/* Rows [0, mb) (at most WIDE2_R, packed in xp) times panels p .. p + np of CpuLinear's
 * groups: a whole group (np WIDE_P), half of one (HALF_P), or the panels after the last whole
 * group (tail: one at a time). Each output's sum is the same whichever. */
static void few_rows_dp(const uint32_t *xp, int64_t xs, int64_t kp, int64_t qc, int64_t mb,
                        int64_t p,
                        int64_t np, int tail, const uint16_t *packed, int64_t panels, int64_t n,
                        const float *bias, float *out, int64_t ldo)
{
    for (int64_t q0 = 0; q0 == 0 || q0 < kp; q0 += qc) { /* K = 0: the bias */
        const int64_t qb = kp - q0 < qc ? kp - q0 : qc;
        for (int64_t j = p; j < p + np; j += tail ? 1 : np) {
            const int64_t last = tail ? j : j + np - 1;
            const int cols = (int)(n - last * NR < NR ? n - last * NR : NR);
            const int64_t qs = panel_qs(j, panels, PANEL_GROUP, 1) * 2 * NR;
            const uint16_t *panel =
                packed + panel_line0(j, kp, panels, PANEL_GROUP, 1) * 2 * NR + q0 * qs;
            const float *pb = bias ? bias + j * NR : 0;
            if (tail) {
                micros_dp[mb](xp + q0 * xs, xs, 0, panel, qs, qb, pb, q0 == 0, 1, out + j * NR,
                              ldo, cols);
                continue;
            }
            const micro_dp_fn *fns = np == WIDE_P ? wides_dp : halves_dp;
            for (int64_t r = 0; r < mb; r += WIDE_R) /* the first ones prefetch */
                fns[mb - r < WIDE_R ? mb - r : WIDE_R](xp + q0 * xs + r, xs, 2 * NR, panel, qs, qb,
                                                        pb, q0 == 0, r == 0,
                                                        out + r * ldo + j * NR, ldo, cols);
        }
    }
}

/* out = x . W^T + bias on bf16 panels in groups of `group` (PANEL_GROUP: CpuLinear's; 1:
 * quant_gemm.c's slices). Every thread of the running parallel region's team calls it (one
 * thread alone where the work is too small to split), as linear_gemm.h's GEMM_TEAM: x's rows
 * are rounded into one thread's buffer (a decode step's: each thread's own), the threads
 * split the panels, and it returns after the team's barrier. */
static void linear_bf16_team(const float *x, int64_t ldx, int64_t m, const uint16_t *packed,
                             int64_t n, int64_t k, const float *bias, float *out, int64_t ldo,
                             int group)
{
    const int64_t panels = (n + NR - 1) / NR, kp = (k + 1) / 2, qc = KC;
    /* a block of rows in packed pairs */
    const size_t block_rows = (size_t)((m < MC ? m : MC) + MR - 1) / MR * MR;
    const size_t words = block_rows * (size_t)(kp ? kp : 1);
    /* A few short rows (a decode step): each thread rounds them into a buffer of its own on its
     * stack, so the team meets once, at the end, not also after one thread's rounding. */
    const int own = m <= WIDE2_R && m * kp <= OWN_PACK_WORDS;
    uint32_t own_xp[own ? m * kp : 1];
    uint32_t *xp = own_xp;
    if (!own) {
        #pragma omp single copyprivate(xp)
        xp = pack_buffer(words * sizeof *xp);
    }
    if (!xp) { /* no memory for the rounded rows: the widening kernel packs on the stack */
        gemm_team_bf16(x, ldx, m, packed, n, k, bias, out, ldo, group);
        return;
    }
#define PANEL(p) (packed + panel_line0(p, kp, panels, group, 1) * 2 * NR) /* its pair 0 */
#define QS(p) (panel_qs(p, panels, group, 1) * 2 * NR)
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mb = m - m0 < MC ? m - m0 : MC;
        /* x's pairs: a few rows side by side (pair q of row r at xp[q mb + r], so one row's
         * pairs share cache lines, which the other threads read), more in blocks of MR */
        const int64_t xs = mb <= WIDE2_R ? mb : MR;
        if (own) {
            for (int64_t r = 0; r < mb; r++) pack_pairs_row(x + (m0 + r) * ldx, k, xp + r, xs);
        } else if (mb * k >= PACK_PARALLEL_MIN) {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < mb; r++)
                pack_pairs_row(x + (m0 + r) * ldx, k, xp + (r / xs) * xs * kp + r % xs, xs);
        } else {
            #pragma omp single
            for (int64_t r = 0; r < mb; r++)
                pack_pairs_row(x + (m0 + r) * ldx, k, xp + (r / xs) * xs * kp + r % xs, xs);
        }
        if (mb <= WIDE2_R && group == WIDE_P) {
            /* A few rows on CpuLinear's groups: each thread takes an equal share of the
             * groups' halves (the panels left over after the last whole group count as one
             * more), a whole group of WIDE_P panels at a time where it holds both halves, so
             * an odd number of groups does not leave one thread a group more to read. */
            const int64_t whole = panels / WIDE_P, halves = 2 * whole;
            const int64_t items = halves + (panels > whole * WIDE_P);
            {
                const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
                const int64_t end = items * (t + 1) / threads;
                for (int64_t u = items * t / threads; u < end;) {
                    const int64_t p = u < halves ? u * HALF_P : halves * HALF_P;
                    const int whole_group = u % 2 == 0 && u + 1 < end &&
                                            !split_group(u / 2, panels, WIDE_P, 1);
                    const int64_t np = u >= halves ? panels - p : whole_group ? WIDE_P : HALF_P;
                    few_rows_dp(xp, xs, kp, qc, mb, p, np, u >= halves, packed, panels, n, bias,
                                out + m0 * ldo, ldo);
                    u += u >= halves ? 1 : np / HALF_P;
                }
            }
            #pragma omp barrier
            continue;
        }
        if (mb <= WIDE2_R) { /* a few rows: WIDE_P panels at a time, WIDE_R rows at a time */
            const int64_t groups = (panels + WIDE_P - 1) / WIDE_P;
            #pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t p0 = g * WIDE_P;
                const int64_t np = panels - p0 < WIDE_P ? panels - p0 : WIDE_P;
                for (int64_t q0 = 0; q0 == 0 || q0 < kp; q0 += qc) { /* K = 0: the bias */
                    const int64_t qb = kp - q0 < qc ? kp - q0 : qc;
                    for (int64_t p = p0; p < p0 + np; p += (np == WIDE_P ? WIDE_P : 1)) {
                        const int64_t last = np == WIDE_P ? p + WIDE_P - 1 : p;
                        const int cols = (int)(n - last * NR < NR ? n - last * NR : NR);
                        const int64_t qs = QS(p);
                        const uint16_t *panel = PANEL(p) + q0 * qs;
                        const float *pb = bias ? bias + p * NR : 0;
                        if (np != WIDE_P) { /* the last panels, one at a time */
                            micros_dp[mb](xp + q0 * xs, xs, 0, panel, qs, qb, pb, q0 == 0, 1,
                                          out + m0 * ldo + p * NR, ldo, cols);
                            continue;
                        }
                        /* one group (WIDE_P is PANEL_GROUP), or panels one to a group */
                        const int64_t pstride = group == 1 ? kp * 2 * NR : 2 * NR;
                        for (int64_t r = 0; r < mb; r += WIDE_R) /* the first ones prefetch */
                            wides_dp[mb - r < WIDE_R ? mb - r : WIDE_R](
                                xp + q0 * xs + r, xs, pstride, panel, qs, qb, pb, q0 == 0, r == 0,
                                out + (m0 + r) * ldo + p * NR, ldo, cols);
                    }
                }
            }
            continue;
        }
        /* whole groups of TP full panels through tile_dp, TR rows at a time; the rest
         * (the last panels, a remainder of rows) through the micro-kernels */
        const int64_t full = n / NR, groups = mb >= TILE_MIN_ROWS ? full / TP : 0;
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t p = g * TP;
            const uint16_t *first[TP];
            int64_t qs[TP];
            for (int j = 0; j < TP; j++) first[j] = PANEL(p + j), qs[j] = QS(p + j);
            for (int64_t q0 = 0; q0 == 0 || q0 < kp; q0 += TQ) {
                const int64_t qb = kp - q0 < TQ ? kp - q0 : TQ;
                const uint16_t *panel[TP];
                for (int j = 0; j < TP; j++) panel[j] = first[j] + q0 * qs[j];
                int64_t r = 0;
                for (; r + TR <= mb; r += TR)
                    tile_dp(xp + (r / MR) * MR * kp + r % MR + q0 * MR, panel, qs, qb,
                            bias ? bias + p * NR : 0, q0 == 0, out + (m0 + r) * ldo + p * NR,
                            ldo, TR);
                for (int64_t j = 0; r < mb && j < TP; j++)
                    micros_dp[mb - r](xp + (r / MR) * MR * kp + r % MR + q0 * MR, MR, 0, panel[j],
                                      qs[j], qb, bias ? bias + (p + j) * NR : 0, q0 == 0, 0,
                                      out + (m0 + r) * ldo + (p + j) * NR, ldo, NR);
            }
        }
        #pragma omp for schedule(static)
        for (int64_t p = groups * TP; p < panels; p++) {
            const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
            const float *pbias = bias ? bias + p * NR : 0;
            float *o = out + m0 * ldo + p * NR;
            const int64_t qs = QS(p);
            for (int64_t q0 = 0; q0 == 0 || q0 < kp; q0 += qc) { /* K = 0: the bias */
                const int64_t qb = kp - q0 < qc ? kp - q0 : qc;
                const uint16_t *panel = PANEL(p) + q0 * qs;
                for (int64_t r = 0; r < mb; r += MR) {
                    const int rows = (int)(mb - r < MR ? mb - r : MR);
                    micros_dp[rows](xp + r * kp + q0 * MR, MR, 0, panel, qs, qb, pbias, q0 == 0,
                                    r == 0, o + r * ldo, ldo, cols);
                }
            }
        }
    }
#undef PANEL
#undef QS
}

/* linear_bf16_team on a team of its own: num_threads, or one thread for too little work. */
void conveyor_linear_bf16_grouped(const float *x, int64_t ldx, int64_t m, const uint16_t *packed,
                                  int64_t n, int64_t k, const float *bias, float *out,
                                  int64_t ldo, int num_threads, int group)
{
    #pragma omp parallel num_threads(num_threads) if (worth_a_team(m, n, k))
    linear_bf16_team(x, ldx, m, packed, n, k, bias, out, ldo, group);
}

void conveyor_linear_bf16(const float *x, int64_t ldx, int64_t m, const uint16_t *packed,
                          int64_t n, int64_t k, const float *bias, float *out, int64_t ldo,
                          int num_threads)
{
    conveyor_linear_bf16_grouped(x, ldx, m, packed, n, k, bias, out, ldo, num_threads,
                                 PANEL_GROUP);
}

#else

/* Without vdpbf16ps the widening kernel is the only one; the name stays for callers that
 * ask for it by name. */
void conveyor_linear_bf16_widened(const float *x, int64_t ldx, int64_t m,
                                  const uint16_t *packed, int64_t n, int64_t k,
                                  const float *bias, float *out, int64_t ldo, int num_threads)
{
    conveyor_linear_bf16(x, ldx, m, packed, n, k, bias, out, ldo, num_threads);
}

void conveyor_linear_bf16_grouped(const float *x, int64_t ldx, int64_t m, const uint16_t *packed,
                                  int64_t n, int64_t k, const float *bias, float *out,
                                  int64_t ldo, int num_threads, int group)
{
    gemm_grouped_bf16(x, ldx, m, packed, n, k, bias, out, ldo, num_threads, group);
}

#endif

/* conveyor_linear_f32 and conveyor_linear_bf16 for a caller already running a parallel region
 * (decoder_layers.c): every thread of its team calls them with the same arguments, and they
 * return after the team's barrier with out written. */
void cv_linear_f32_team(const float *x, int64_t ldx, int64_t m, const float *packed,
                        int64_t n, int64_t k, const float *bias, float *out, int64_t ldo)
{
    gemm_team_f32(x, ldx, m, packed, n, k, bias, out, ldo, PANEL_GROUP);
}

void cv_linear_bf16_team(const float *x, int64_t ldx, int64_t m, const uint16_t *packed,
                         int64_t n, int64_t k, const float *bias, float *out, int64_t ldo)
{
#if defined(CONVEYOR_DPBF16)
    linear_bf16_team(x, ldx, m, packed, n, k, bias, out, ldo, PANEL_GROUP);
#else
    gemm_team_bf16(x, ldx, m, packed, n, k, bias, out, ldo, PANEL_GROUP);
#endif
}

/* Whether this build's GEMM is a vector kernel (AVX2 + FMA or above; else the portable
 * loop above). */
int conveyor_linear_f32_vectorized(void)
{
#ifdef CONVEYOR_AVX2
    return 1;
#else
    return 0;
#endif
}

/* Which GEMM this build has: 0 the portable loop, 1 AVX2 + FMA, 2 AVX-512 (zmm accumulators,
 * bf16 weights widened), 3 AVX-512 with bf16 panels through vdpbf16ps (AVX512-BF16). */
int conveyor_linear_isa(void)
{
#if defined(CONVEYOR_DPBF16)
    return 3;
#elif defined(CONVEYOR_GEMM512)
    return 2;
#elif defined(CONVEYOR_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Rows `ids` (count of them) of a packed W [n, k] (float32 lines, or bf16 pairs when bf16 is
 * set) as float32 in out (ldo floats apart): a tied model's embedding lookup in its head's
 * panels, in one call rather than a dozen tensor ops a token. A row's k values lie one (or
 * one pair) to a line, each line `qs` lines after the last within its group. Returns 1 when
 * an id is outside [0, n), writing nothing then, else 0. */
int conveyor_linear_rows(const void *packed, int bf16, int64_t n, int64_t k, const int64_t *ids,
                         int64_t count, float *out, int64_t ldo, int num_threads)
{
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n)
            return 1;
    const int64_t panels = (n + NR - 1) / NR, lines = bf16 ? (k + 1) / 2 : k;
#pragma omp parallel for num_threads(num_threads) if (count * k >= PACK_PARALLEL_MIN)
    for (int64_t i = 0; i < count; i++) {
        const int col = (int)(ids[i] % NR);
        const int split = bf16 && SPLIT_BF16; /* CpuLinear's layout for bf16 panels */
        const int64_t p = ids[i] / NR, line0 = panel_line0(p, lines, panels, PANEL_GROUP, split);
        /* elements a line apart */
        const int64_t step = panel_qs(p, panels, PANEL_GROUP, split) * NR;
        float *o = out + i * ldo;
        if (bf16) {
            const uint16_t *w = (const uint16_t *)packed + line0 * NR * 2;
            for (int64_t kk = 0; kk < k; kk++)
                o[kk] = bf16_at(w + (kk >> 1) * step * 2, kk, col);
        } else {
            const float *w = (const float *)packed + line0 * NR + col;
            for (int64_t kk = 0; kk < k; kk++)
                o[kk] = w[kk * step];
        }
    }
    return 0;
}

/* CpuLinear's packed weights as the GEMMs read them (gemm.c's header), and the blocking the
 * variants share: the panels' layout in groups, the K block, when a GEMM takes a team, and
 * the AVX-512 blocking of gemm_avx512.c and gemm_avx512bf16.c. */
#ifndef CONVEYOR_GEMM_PANELS_H
#define CONVEYOR_GEMM_PANELS_H

#include <stdint.h>

#include "kernels.h"
#include "vec_math.h"

#define NR 16
/* Panels are stored in groups of PANEL_GROUP side by side, line by line (a line: one k's 16
 * float32, or one pair of k's 16 bf16 pairs; 64 bytes either way): the group's line 0 of each
 * panel, then line 1 of each, ... (the last group has the panels left over). A decode step,
 * which takes a group's panels together (WIDE_P, the same four), so reads the weights as one
 * stream per thread. Four streams per thread, one per panel, read slower
 * (docs/kernels.md#measured-choices). quant_gemm.c's slices are panels one to a
 * group (gemm_bf16_bf16_grouped). */
#define PANEL_GROUP 4

/* bf16 panels for vdpbf16ps (`split`): with an odd number of whole groups of PANEL_GROUP,
 * the middle one is stored as two groups of half as many panels (each half's lines side by
 * side, the first half's before the second's). A decode step's two threads split the groups
 * by halves (few_rows_dp), so each one's share is then one stream; interleaved in one group,
 * the half a thread read first pulled much of the other half through the prefetchers, and
 * an odd number of groups left one thread longer than the other
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

/* bfloat16 weights: [panels][ceil(K / 2)][16][2] uint16, k in pairs (an odd K's last pair
 * padded with a zero), so that the 32-bit word of column j holds k = 2i in its low half and
 * k = 2i + 1 in its high half (CpuLinear packs them so). That is the operand vdpbf16ps takes;
 * widened, a bf16 is the top half of its float32, so one load of a pair's words gives both
 * k in one integer operation each: a shift left by 16 (even k) or a mask of the high halves
 * (odd k; AVX2 clears the low halves with two shifts instead). Widened, the products and sums
 * are float32, as with float32 weights. */
static inline float bf16_at(const uint16_t *line, int64_t kk, int j)
{
    return bf16_to_f32(line[2 * j + (kk & 1)]);
}

/* The weights' forms gemm_team.h's loops take (W_FORM): float32 panels, a line a k; bf16
 * pairs widened to float32 one k at a time (two k a line); bf16 pairs taken as pairs
 * (vdpbf16ps: a pair a line). */
#define W_F32 0
#define W_BF16 1
#define W_PAIRS 2

#if defined(CONVEYOR_GEMM512)
/* 32 zmm registers: MR accumulators, the panel's zmm and the broadcast x. */
#define MR 16
#define MC 288 /* a multiple of MR: 288 x 256 floats of x, 288 KiB */
#define PREFETCH_LINES 32 /* ahead in the panel's own lines (2 KiB of them; 16 read slower) */
/* A few rows (at most WIDE_R): WIDE_P panels per micro-kernel call. */
#define WIDE_R 4
#define WIDE_P 4 /* PANEL_GROUP: a decode step takes a group at a time */
#define HALF_P 2 /* or half of one (gemm_avx512bf16.c's few_rows_dp) */
/* 5-16 rows (a decode step of that many sequences) take the same kernels four rows at a time
 * over each block of four panels, the later rows re-reading the panels' block from L1: one
 * panel at a time left a step of 8 rows much longer than one of 4 (eight dependency chains
 * too few to keep the weights streaming) and 16 rows bound by their loads (a broadcast and a
 * weight load for each 16 x 1 instruction's worth) (docs/kernels.md#measured-choices). */
#define WIDE2_R 16
#endif

#endif

/* Linear layers for CPU: out = x @ W^T + bias, x, bias and out float32, with W [N, K] packed
 * once at load into panels of NR = 16 output columns (the last panel zero-padded;
 * conveyor.model.cpu.linear.CpuLinear packs them), a panel a run of 64-byte lines: float32,
 * a line one k's 16 weights (gemm_f32_f32), or bfloat16, a line one pair of k's 16 pairs
 * [16][2] (gemm_bf16_*: half the bytes to stream). The panels are stored four to a group,
 * line by line (gemm_panels.h's PANEL_GROUP). This file holds the entry points; the build
 * compiles one of four variants by what the compiler may use (-march=native: this CPU's
 * features; CONVEYOR_CPU_ISA forces a lower one), each in a file of its own, and gemm_isa
 * says which:
 *
 *   AVX2 + FMA   gemm_avx2.c: a 6 x 16 block of out in twelve ymm registers; for each k the
 *                panel's 16 weights are loaded once (two vectors) and one x value per row
 *                broadcast: 12 FMAs for 8 loads, the classic shape for 16 vector registers;
 *                for 1-3 rows (decode) one row by a group's four panels at a time instead.
 *                bf16 weights are widened to float32 in registers (the same float32
 *                products and sums).
 *   AVX-512      gemm_avx512.c: 16 columns are one zmm: up to 16 rows x 16 columns of
 *                accumulators, x's block of rows packed first (pack_rows) so the values
 *                broadcast for one k share a cache line; for 1-16 rows (decode) four panels
 *                per call, four rows at a time, so a step is not bound by one FMA chain's
 *                latency per k. bf16 widened as above.
 *   AVX512-BF16  gemm_avx512bf16.c: bf16 weights through vdpbf16ps (gemm_bf16_bf16): x
 *                rounded to bf16 (nearest even) once per block of rows, each instruction
 *                two k per lane; the same blocking. This changes bf16 mode's numerics (x
 *                rounded, as oneDNN's and vLLM-CPU's bf16 linears do); float32 weights are
 *                untouched. The widening kernel stays callable (gemm_bf16_f32).
 *   generic      gemm_generic.c: a plain C loop over the same panels (no AVX2:
 *                CONVEYOR_CPU_ISA=portable, an older x86-64, aarch64).
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
#include <stdlib.h>

#include "gemm_panels.h"
#include "kernels.h"

/* The build's variant of the team GEMM for float32 (f32) or bf16 weights widened (bf16); every
 * thread of a team calls it. */
#if defined(CONVEYOR_GEMM512)
#define TEAM(w) gemm_##w##_f32_team_avx512
#elif defined(CONVEYOR_AVX2)
#define TEAM(w) gemm_##w##_f32_team_avx2
#else
#define TEAM(w) gemm_##w##_f32_team_generic
#endif

/* The entry points run the build's team GEMM on a team of their own (num_threads, or one
 * thread for too little work); the team forms, for a caller already running a parallel region
 * (decoder_layers.c), on the caller's: every thread of its team calls them with the same
 * arguments, and they return after the team's barrier with out written. */
#define ON_A_TEAM(team, group)                                                                 \
    _Pragma("omp parallel num_threads(num_threads) if (worth_a_team(m, n, k))")                \
    team(x, ldx, m, packed, n, k, bias, out, ldo, group)
#define ON_THE_CALLERS(team) team(x, ldx, m, packed, n, k, bias, out, ldo, PANEL_GROUP)

/* The calling thread's buffer for x packed for the micro-kernels (or rounded to pairs, in
 * gemm_avx512bf16.c); here, in no instruction set's file, as gemm_team.h calls it from each, grown as needed and kept (NULL when it cannot grow: the callers then
 * pack per micro-kernel call, on the stack). */
static _Thread_local void *pack_buf;
static _Thread_local size_t pack_cap;

void *gemm_pack_buffer(size_t bytes)
{
    if (bytes > pack_cap) {
        void *grown = realloc(pack_buf, bytes);
        if (!grown) return 0;
        pack_buf = grown, pack_cap = bytes;
    }
    return pack_buf;
}

CONVEYOR_EXPORT void gemm_f32_f32(GEMM_OPERANDS(float), int num_threads)
{
    ON_A_TEAM(TEAM(f32), PANEL_GROUP);
}

CONVEYOR_EXPORT void gemm_bf16_f32(GEMM_OPERANDS(uint16_t), int num_threads)
{
    ON_A_TEAM(TEAM(bf16), PANEL_GROUP);
}

CONVEYOR_EXPORT void gemm_bf16_f32_grouped(GEMM_OPERANDS(uint16_t), int num_threads, int group)
{
    ON_A_TEAM(TEAM(bf16), group);
}

void gemm_f32_f32_team(GEMM_OPERANDS(float)) { ON_THE_CALLERS(TEAM(f32)); }

void gemm_bf16_f32_team(GEMM_OPERANDS(uint16_t)) { ON_THE_CALLERS(TEAM(bf16)); }

#ifdef CONVEYOR_DPBF16
CONVEYOR_EXPORT void gemm_bf16_bf16(GEMM_OPERANDS(uint16_t), int num_threads)
{
    ON_A_TEAM(gemm_bf16_bf16_team_avx512bf16, PANEL_GROUP);
}

CONVEYOR_EXPORT void gemm_bf16_bf16_grouped(GEMM_OPERANDS(uint16_t), int num_threads, int group)
{
    ON_A_TEAM(gemm_bf16_bf16_team_avx512bf16, group);
}

void gemm_bf16_bf16_team(GEMM_OPERANDS(uint16_t))
{
    ON_THE_CALLERS(gemm_bf16_bf16_team_avx512bf16);
}
#endif

CONVEYOR_EXPORT int gemm_isa(void)
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

/* Rows `ids` (count of them) of a packed W [n, k] (float32 lines, or bf16 pairs) as float32
 * in out (ldo floats apart): a tied model's embedding lookup in its head's panels, in one
 * call rather than a dozen tensor ops a token. A row's k values lie one (or one pair) to a
 * line, each line `qs` lines after the last within its group. Returns 1 when an id is
 * outside [0, n), writing nothing then, else 0. */
static inline __attribute__((always_inline)) int
rows(const void *packed, const int bf16, int64_t n, int64_t k, const int64_t *ids, int64_t count,
     float *out, int64_t ldo, int num_threads)
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

CONVEYOR_EXPORT int rows_f32_f32(const float *packed, int64_t n, int64_t k, const int64_t *ids,
                                 int64_t count, float *out, int64_t ldo, int num_threads)
{
    return rows(packed, 0, n, k, ids, count, out, ldo, num_threads);
}

CONVEYOR_EXPORT int rows_bf16_f32(const uint16_t *packed, int64_t n, int64_t k,
                                  const int64_t *ids, int64_t count, float *out, int64_t ldo,
                                  int num_threads)
{
    return rows(packed, 1, n, k, ids, count, out, ldo, num_threads);
}

/* The GEMM on AVX-512 (gemm.c's header): 16 columns are one zmm, up to 16 rows x 16 columns
 * of accumulators, x's block of rows packed first (pack_rows) so the values broadcast for one
 * k share a cache line; for 1-16 rows (decode) four panels per call, four rows at a time, so
 * a step is not bound by one FMA chain's latency per k. bf16 weights are widened to float32
 * in registers (the same float32 products and sums as float32 weights); gemm_avx512bf16.c
 * has the vdpbf16ps kernel. gemm_avx512_team.h is the kernel, once per weight type.
 */
#include "kernels.h"

#ifdef CONVEYOR_GEMM512

#include <immintrin.h>
#include <stdlib.h>

#include "gemm_panels.h"

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

/* The same buffer for gemm_avx512bf16.c's rounded rows. */
void *gemm_pack_buffer(size_t bytes) { return pack_buffer(bytes); }

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

/* float32 weights: [panels][K][16] floats. */
#define GEMM_TEAM gemm_f32_f32_team_avx512
#define W_T float
#define SUFFIX _f32
#define KSTEP(k) (k)
#define K_PER_LINE 1
#define PREFETCH_ODD 1 /* every k starts a 64-byte line */
#define LINE_AT(panel, kk, qs) ((panel) + (kk) * (qs))
#define LOAD_W512(panel, kk, odd, qs) _mm512_loadu_ps(LINE_AT(panel, kk, qs))
#define W_SPLIT 0 /* float32 groups are never split */
#include "gemm_avx512_team.h"
#undef GEMM_TEAM
#undef W_T
#undef W_SPLIT
#undef SUFFIX
#undef KSTEP
#undef K_PER_LINE
#undef PREFETCH_ODD
#undef LINE_AT
#undef LOAD_W512

/* bfloat16 weights (gemm_panels.h), widened: a shift left by 16 (even k) or a mask of the
 * high halves (odd k). */
#define GEMM_TEAM gemm_bf16_f32_team_avx512
#define W_T uint16_t
#define SUFFIX _bf16
#define KSTEP(k) ((k) + ((k) & 1))
#define K_PER_LINE 2
#define PREFETCH_ODD 0 /* a pair of k is one 64-byte line */
#define LINE_AT(panel, kk, qs) ((panel) + ((kk) >> 1) * (qs))
#define LOAD_W512(panel, kk, odd, qs)                                                          \
    _mm512_castsi512_ps(odd ? _mm512_and_si512(_mm512_loadu_si512(LINE_AT(panel, kk, qs)),     \
                                               _mm512_set1_epi32((int)0xFFFF0000u))            \
                            : _mm512_slli_epi32(_mm512_loadu_si512(LINE_AT(panel, kk, qs)), 16))
#define W_SPLIT SPLIT_BF16 /* CpuLinear's layout for this build's bf16 panels */
#include "gemm_avx512_team.h"
#undef GEMM_TEAM
#undef W_T
#undef W_SPLIT
#undef SUFFIX
#undef KSTEP
#undef K_PER_LINE
#undef PREFETCH_ODD
#undef LINE_AT
#undef LOAD_W512

#endif

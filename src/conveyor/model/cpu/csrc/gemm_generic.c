/* The GEMM in plain C, the fallback of a build without AVX2 + FMA (CONVEYOR_CPU_ISA=portable,
 * an older x86-64, aarch64): the same panels (gemm_panels.h) and the same sum per output
 * (bias first, then k in order), PR rows at a time so each weight load serves PR rows; the
 * compiler vectorises the 16 columns with what the target has (SSE2, NEON). */
#include <string.h>

#include "gemm_panels.h"
#include "kernels.h"

#define PR 4 /* rows per weight load */

/* Column j of k = kk in a panel whose lines are qs elements apart. */
static inline __attribute__((always_inline)) float w_at(const void *panel, const int bf16,
                                                        int64_t kk, int j, int64_t qs)
{
    if (bf16) return bf16_at((const uint16_t *)panel + (kk >> 1) * qs, kk, j);
    return ((const float *)panel)[kk * qs + j];
}

/* Called by every thread of a team, as the vector variants: the threads split the panels. */
static inline __attribute__((always_inline)) void
team(const int bf16, const float *x, int64_t ldx, int64_t m, const void *packed, int64_t n,
     int64_t k, const float *bias, float *out, int64_t ldo, int group)
{
    const int64_t line_elems = bf16 ? 32 : 16; /* a line is 64 bytes either way */
    const int split = bf16 ? SPLIT_BF16 : 0;   /* CpuLinear's layout for this build's panels */
    const int64_t panels = (n + NR - 1) / NR, lines = bf16 ? (k + (k & 1)) / 2 : k;
    #pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
        const int64_t qs = panel_qs(p, panels, group, split) * line_elems;
        const void *panel = (const char *)packed + panel_line0(p, lines, panels, group, split) * 64;
        for (int64_t r0 = 0; r0 < m; r0 += PR) {
            const int rows = (int)(m - r0 < PR ? m - r0 : PR);
            float acc[PR][NR];
            for (int r = 0; r < PR; r++)
                for (int j = 0; j < NR; j++)
                    acc[r][j] = bias && j < cols ? bias[p * NR + j] : 0.f;
            for (int64_t kk = 0; kk < k; kk++) {
                float w[NR];
                for (int j = 0; j < NR; j++) w[j] = w_at(panel, bf16, kk, j, qs);
                for (int r = 0; r < rows; r++) {
                    const float a = x[(r0 + r) * ldx + kk];
                    for (int j = 0; j < NR; j++)
                        acc[r][j] += a * w[j];
                }
            }
            for (int r = 0; r < rows; r++)
                memcpy(out + (r0 + r) * ldo + p * NR, acc[r], cols * sizeof(float));
        }
    }
}

void gemm_f32_f32_team_generic(GEMM_TEAM_ARGS(float))
{
    team(0, x, ldx, m, packed, n, k, bias, out, ldo, group);
}

void gemm_bf16_f32_team_generic(GEMM_TEAM_ARGS(uint16_t))
{
    team(1, x, ldx, m, packed, n, k, bias, out, ldo, group);
}

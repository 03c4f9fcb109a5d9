/* A mixture of experts' feed-forward in one call (one OpenMP region): models/moe.py's module
 * loop over QuantLinear experts bit for bit (CpuLinear ones to float rounding: the team GEMM
 * may split the sums otherwise):
 *
 *   pairs (token, slot) grouped by expert, in token order (a counting sort)
 *   for each expert e that a token chose, in index order:
 *       xg  = the rows of x of its tokens            (gathered)
 *       act = silu(xg @ Wgu_e.T [gate]) * (xg @ Wgu_e.T [up])
 *       y   = (act @ Wdown_e.T) * each row's routing weight
 *       out[token] += y                               (one add per row: a token picks an
 *                                                      expert once)
 *
 * The linears are linear_f32_team's (the fused decoder layers' kernels), so a decode step's
 * chosen experts cost their weight reads and a few barriers, not a Python call per linear.
 * The products and the adds are separate loops: the product is rounded before the add, as in
 * torch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

CONVEYOR_EXPORT int moe_f32(const moe_args *a)
{
    const int64_t t = a->t, k = a->top_k, pairs = t * k;
    const int e_count = a->num_experts, hidden = a->hidden, inter = a->inter;
    int64_t *start = calloc((size_t)e_count + 1, sizeof(int64_t));
    int64_t *order = malloc((size_t)(pairs ? pairs : 1) * sizeof(int64_t));
    int64_t *next = malloc((size_t)e_count * sizeof(int64_t));
    if (!start || !order || !next) {
        free(start);
        free(order);
        free(next);
        return 3;
    }
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t e = a->topk_ids[p];
        if (e < 0 || e >= e_count) {
            free(start);
            free(order);
            free(next);
            return 4;
        }
        start[e + 1]++;
    }
    for (int e = 0; e < e_count; e++) {
        start[e + 1] += start[e];
        next[e] = start[e];
    }
    for (int64_t p = 0; p < pairs; p++)
        order[next[a->topk_ids[p]]++] = p;
    int status = 0;
    #pragma omp parallel num_threads(a->num_threads)
    {
        int code = 0;
        for (int e = 0; e < e_count; e++) {
            const int64_t n = start[e + 1] - start[e];
            if (!n)
                continue;
            const int64_t *pe = order + start[e];
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++)
                memcpy(a->xg + r * hidden, a->x + (pe[r] / k) * hidden,
                       (size_t)hidden * sizeof(float));
            if (linear_f32_team(&a->gate_up[e], a->xg, n, a->gate_up_out, a->xq, a->passes)) {
                code = 1;
                break;
            }
            silu_mul_f32_team(a->gate_up_out, 2 * (int64_t)inter, a->act, inter, n, inter);
            if (linear_f32_team(&a->down[e], a->act, n, a->y, a->xq, a->passes)) {
                code = 1;
                break;
            }
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) {
                const float w = a->topk_weights[pe[r]];
                float *yr = a->y + r * hidden;
                for (int i = 0; i < hidden; i++)
                    yr[i] *= w;
            }
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) {
                float *o = a->out + (pe[r] / k) * hidden;
                const float *yr = a->y + r * hidden;
                for (int i = 0; i < hidden; i++)
                    o[i] += yr[i];
            }
        }
        #pragma omp master
        status = code;
    }
    free(start);
    free(order);
    free(next);
    return status;
}

/* Every decoder layer of one step in one call: the same kernels, in the same order and on the
 * same values, as the layers' Python modules call them one by one (model/models/llama.py:
 * LlamaDecoderLayer with RMSNorm, RopeStep, CpuAttentionBackend and GatedMLP on these C
 * kernels, and CpuLinear or QuantLinear linears), so the result is bit for bit theirs.
 *
 * What it saves is the Python between the kernels: a decode step of a 30-layer model makes
 * about 300 kernel calls, each reached through an nn.Module call, argument checks, a tensor
 * allocation and a ctypes call: on a small model as much as its weights take to read
 * (docs/kernels.md#measured-choices). model/cpu/fused_layers.py builds the per-layer descriptors
 * (kernels.h's layer_desc, step_desc) once and calls this once a step when the step qualifies (float32 activations, no tensor
 * parallelism, every attention row on the C kernel, GGUF blocks under quant_linear.py's
 * threshold where it has one); anything else runs the modules.
 *
 * One layer, x [t, hidden] coming in and the residual stream r [t, hidden]:
 *   layer 0: r = x, x = rms_norm(r) * w_in       (the caller passes the embedding as r)
 *   else:    r += x, x = rms_norm(r) * w_in      (add_rms_norm, in place)
 *   qkv = x @ Wqkv.T (+ b); rotary on q and k heads in place
 *   attn = paged_attention(q; k, v written to the cache first)
 *   o = attn @ Wo.T (+ b); r += o, o = rms_norm(r) * w_post
 *   x = (silu(gate) * up of o @ Wgu.T) @ Wdown.T
 * and after the last layer the model's final norm: r += x, x = rms_norm(r) * w_final.
 */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* One linear through the team forms of the kernels the modules call: bf16 panels through
 * this build's bf16 GEMM, as CpuKernels.linear picks it. */
int linear_f32_team(const linear_desc *l, const float *x, int64_t m, float *out, void *xq,
                    int passes)
{
    if (l->kind == 0) {
        gemm_f32_f32_team(x, l->k, m, (const float *)l->panels, l->n, l->k, l->bias, out, l->n);
        return 0;
    }
    if (l->kind == 1) {
#ifdef CONVEYOR_DPBF16
        gemm_bf16_bf16_team(x, l->k, m, (const uint16_t *)l->panels, l->n, l->k, l->bias, out,
                            l->n);
#else
        gemm_bf16_f32_team(x, l->k, m, (const uint16_t *)l->panels, l->n, l->k, l->bias, out,
                           l->n);
#endif
        return 0;
    }
    /* A decode step's few rows: each thread quantizes them into its own stack buffer, so the
     * team does not meet before the dot products; more rows, into the shared xq. */
    const size_t own = quantize_q8a_own_bytes(m, l->k, passes);
    _Alignas(64) unsigned char own_xq[own ? own : 1];
    if (own)
        quantize_q8a_f32_own(x, l->k, m, l->k, own_xq, passes);
    else
        quantize_q8a_f32_team(x, l->k, m, l->k, xq, passes);
    for (int i = 0; i < l->parts; i++)
        if (gemm_gguf_q8a_team(l->qtype[i], l->w[i], l->ldw[i], l->rows[i], l->k,
                               own ? (void *)own_xq : xq, m, passes, l->qbias[i],
                               out + l->start[i], l->n, own != 0))
            return 1;
    return 0;
}

/* Returns 0, or (layer index << 8) | what failed: 1 a quantized type the kernel does not
 * handle, else the attention kernel's bits (2: a key range, 4: a cache slot, 1: memory) << 1.
 * Buffers (float32, contiguous rows): x and o [t, hidden], residual [t, hidden] (the
 * embedding coming in), qkv [t, (hq + 2 hkv) d], attn [t, hq d], gate_up [t, 2 inter],
 * act [t, inter]; xq the activations' blocks for the largest k (passes x t x k / 32 x 40 B).
 * After the last layer, residual += x and x = rms_norm(residual) * s->final_norm: x ends as
 * the model's final hidden states.
 *
 * The whole step is one OpenMP parallel region: each kernel splits its work among the team
 * and ends in a barrier, where calling the kernels one by one forked and joined the threads
 * for each (a decode step's five parallel kernels a layer: for a small model a large share of
 * the layers' time, docs/kernels.md#measured-choices). A failure is
 * the same in every thread (a linear's type, or the attention bits shared through
 * attn_failed), so they all leave the loop at the same layer. */
CONVEYOR_EXPORT int decoder_layers_f32(const layer_desc *layers, int n_layers,
                                       const attention_rows *row_sets, const step_desc *s,
                                       float *x, float *residual, float *o, float *qkv,
                                       float *attn, float *gate_up, float *act, void *xq)
{
    const int64_t t = s->t;
    const int hidden = s->hidden, d = s->d, hq = s->hq, hkv = s->hkv;
    const int64_t qkv_w = (int64_t)(hq + 2 * hkv) * d;
    int status = 0, attn_failed = 0;
    #pragma omp parallel num_threads(s->num_threads)
    {
        int code = 0;
        for (int i = 0; i < n_layers; i++) {
            const layer_desc *L = layers + i;
            const attention_rows *R = row_sets + L->rows_set;
            if (i == 0)
                rms_norm_f32_f32_team(residual, hidden, x, hidden, L->in_norm, t, hidden,
                                      L->in_eps);
            else
                add_rms_norm_f32_f32_team(x, hidden, residual, hidden, L->in_norm, t, hidden,
                                          L->in_eps);
            if (linear_f32_team(&L->qkv, x, t, qkv, xq, s->passes)) {
                code = (i << 8) | 1;
                break;
            }
            /* no barrier: the attention kernel's first loop writes each row's K and V to
             * the cache from the thread that rotated it, and its barrier ends both */
            rotary_f32_team_nowait(qkv, qkv_w, t, hq + hkv, d, s->positions, s->cos_sin);
            const attention_args args = {
                .q = qkv, .q_stride = qkv_w, .out = attn, .out_stride = (int64_t)hq * d,
                .k_cache = L->k_cache, .v_cache = L->v_cache,
                .hq = hq, .hkv = hkv, .d = d, .block_size = s->block_size, .scale = s->scale,
                .num_threads = s->num_threads,
                .new_k = qkv + (int64_t)hq * d, .new_k_stride = qkv_w,
                .new_v = qkv + (int64_t)(hq + hkv) * d, .new_v_stride = qkv_w,
                .slots = s->slots, .n_new = t, .num_slots = s->num_slots,
            };
            if (s->kv_bf16)
                paged_attention_bf16_f32_team(R, &args, &attn_failed);
            else
                paged_attention_f32_f32_team(R, &args, &attn_failed);
            if (attn_failed) {
                code = (i << 8) | (attn_failed << 1);
                break;
            }
            if (linear_f32_team(&L->o, attn, t, o, xq, s->passes)) {
                code = (i << 8) | 1;
                break;
            }
            add_rms_norm_f32_f32_team(o, hidden, residual, hidden, L->post_norm, t, hidden,
                                      L->post_eps);
            if (linear_f32_team(&L->gate_up, o, t, gate_up, xq, s->passes)) {
                code = (i << 8) | 1;
                break;
            }
            silu_mul_f32_team(gate_up, 2 * (int64_t)s->inter, act, s->inter, t, s->inter);
            if (linear_f32_team(&L->down, act, t, x, xq, s->passes)) {
                code = (i << 8) | 1;
                break;
            }
        }
        if (!code)
            add_rms_norm_f32_f32_team(x, hidden, residual, hidden, s->final_norm, t, hidden,
                                      s->final_eps);
        #pragma omp master
        status = code;
    }
    return status;
}

/* Every decoder layer of one step in one call: the same kernels, in the same order and on the
 * same values, as the layers' Python modules call them one by one (model/models/llama.py:
 * LlamaDecoderLayer with RMSNorm, RopeStep, CpuAttentionBackend and GatedMLP on these C
 * kernels, and CpuLinear or QuantLinear linears), so the result is bit for bit theirs.
 *
 * What it saves is the Python between the kernels: a decode step of a 30-layer model makes
 * about 300 kernel calls, each reached through an nn.Module call, argument checks, a tensor
 * allocation and a ctypes call: on a small model as much as its weights take to read
 * (docs/kernels.md#measured-choices). model/cpu/fused_layers.py builds the per-layer descriptors once
 * and calls this once a step when the step qualifies (float32 activations, no tensor
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
#include <stdint.h>
#include <stddef.h>
#include <string.h>

/* The kernels of the other files (one library), in their forms for a caller running a
 * parallel region: every thread of the team calls each one with the same arguments, and it
 * returns after the team's barrier with its output written. (cv_: called only inside the
 * library; the conveyor_ entry points are the ones cpu_kernels.py binds.) */
void cv_linear_f32_team(const float *x, int64_t ldx, int64_t m, const float *packed,
                        int64_t n, int64_t k, const float *bias, float *out, int64_t ldo);
void cv_linear_bf16_team(const float *x, int64_t ldx, int64_t m, const uint16_t *packed,
                         int64_t n, int64_t k, const float *bias, float *out, int64_t ldo);
void cv_quantize_q8a_team(const float *x, int64_t ldx, int64_t m, int64_t k, void *out,
                          int passes);
size_t cv_q8a_own_bytes(int64_t m, int64_t k, int passes);
void cv_quantize_q8a_own(const float *x, int64_t ldx, int64_t m, int64_t k, void *out,
                         int passes);
int cv_quant_linear_team(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                         const void *xq, int64_t m, int passes, const float *bias,
                         float *out, int64_t ldo, int own);
void cv_add_rms_norm_team(float *x, int64_t x_stride, float *residual, int64_t r_stride,
                          const float *w, int64_t rows, int hidden, float eps);
void cv_rms_norm_team(const float *x, int64_t x_stride, float *out, int64_t out_stride,
                      const float *w, int64_t rows, int hidden, float eps);
void cv_rotary_team_nowait(float *x, int64_t row_stride, int64_t rows, int num_heads,
                           int d, const int64_t *positions, const float *cos_sin);
void cv_silu_mul_team(const float *gate_up, int64_t in_stride, float *out,
                      int64_t out_stride, int64_t rows, int inter);
#define ATTENTION_TEAM(name, KV_T)                                                             \
    void name(const float *q, int64_t q_row_stride, float *out, int64_t out_row_stride,        \
              KV_T *k_cache, KV_T *v_cache, const int32_t *block_tables, int64_t bt_stride,    \
              const int32_t *key_begin, const int32_t *key_end, const int64_t *rows,           \
              const int64_t *batch, int64_t n, int hq, int hkv, int d, int block_size,         \
              int max_keys, float scale, const float *new_k, int64_t new_k_stride,             \
              const float *new_v, int64_t new_v_stride, const int64_t *slots, int64_t n_new,   \
              int64_t num_slots, int *team_failed);
ATTENTION_TEAM(cv_paged_attention_team_f32, float)
ATTENTION_TEAM(cv_paged_attention_team_bf16, uint16_t)
#undef ATTENTION_TEAM

#define MAX_PARTS 4

/* One linear layer: float32 or bfloat16 panels (CpuLinear) or GGUF blocks (QuantLinear, up
 * to MAX_PARTS pieces stacked by rows, each with its type). Mirrored by fused_layers.py. */
typedef struct {
    int32_t kind; /* 0: float32 panels, 1: bfloat16 panels, 2: GGUF blocks */
    int32_t parts;
    int64_t n, k;
    const void *panels;
    const float *bias; /* kinds 0, 1 (NULL: none) */
    int32_t qtype[MAX_PARTS];
    const uint8_t *w[MAX_PARTS];
    int64_t ldw[MAX_PARTS], rows[MAX_PARTS], start[MAX_PARTS];
    const float *qbias[MAX_PARTS]; /* kind 2: each piece's bias slice (NULL: none) */
} cv_linear;

typedef struct {
    const float *in_norm, *post_norm;
    float in_eps, post_eps;
    int32_t rows_set; /* which of the step's attention row sets (its sliding window) */
    void *k_cache, *v_cache;
    cv_linear qkv, o, gate_up, down;
} cv_layer;

/* The rows the attention kernel attends and their keys, for one sliding window. */
typedef struct {
    const int32_t *block_tables;
    int64_t bt_stride;
    const int32_t *key_begin, *key_end;
    const int64_t *rows, *batch;
    int64_t n;
    int32_t max_keys;
} cv_rows;

typedef struct {
    int64_t t;
    int32_t hidden, hq, hkv, d, inter, block_size, kv_bf16, passes, num_threads;
    float scale;
    const int64_t *positions;
    const float *cos_sin;
    const int64_t *slots;
    int64_t num_slots;
    const float *final_norm; /* the model's last RMSNorm, after the layers */
    float final_eps;
} cv_step;

static int run_linear(const cv_linear *l, const float *x, int64_t m, float *out, void *xq,
                      int passes)
{
    if (l->kind == 0) {
        cv_linear_f32_team(x, l->k, m, (const float *)l->panels, l->n, l->k, l->bias, out,
                           l->n);
        return 0;
    }
    if (l->kind == 1) {
        cv_linear_bf16_team(x, l->k, m, (const uint16_t *)l->panels, l->n, l->k, l->bias,
                            out, l->n);
        return 0;
    }
    /* A decode step's few rows: each thread quantizes them into its own stack buffer, so the
     * team does not meet before the dot products; more rows, into the shared xq. */
    const size_t own = cv_q8a_own_bytes(m, l->k, passes);
    _Alignas(64) unsigned char own_xq[own ? own : 1];
    if (own)
        cv_quantize_q8a_own(x, l->k, m, l->k, own_xq, passes);
    else
        cv_quantize_q8a_team(x, l->k, m, l->k, xq, passes);
    for (int i = 0; i < l->parts; i++)
        if (cv_quant_linear_team(l->qtype[i], l->w[i], l->ldw[i], l->rows[i], l->k,
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
 * for each (a decode step's five parallel kernels a layer; for SmolLM2-135M that fork and join
 * cost more than 10 % of the layers' time, docs/kernels.md#measured-choices). A failure is
 * the same in every thread (a linear's type, or the attention bits shared through
 * attn_failed), so they all leave the loop at the same layer. */
int conveyor_decoder_layers(const cv_layer *layers, int n_layers, const cv_rows *row_sets,
                            const cv_step *s, float *x, float *residual, float *o, float *qkv,
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
            const cv_layer *L = layers + i;
            const cv_rows *R = row_sets + L->rows_set;
            if (i == 0)
                cv_rms_norm_team(residual, hidden, x, hidden, L->in_norm, t, hidden,
                                 L->in_eps);
            else
                cv_add_rms_norm_team(x, hidden, residual, hidden, L->in_norm, t, hidden,
                                     L->in_eps);
            if (run_linear(&L->qkv, x, t, qkv, xq, s->passes)) {
                code = (i << 8) | 1;
                break;
            }
            /* no barrier: the attention kernel's first loop writes each row's K and V to
             * the cache from the thread that rotated it, and its barrier ends both */
            cv_rotary_team_nowait(qkv, qkv_w, t, hq + hkv, d, s->positions, s->cos_sin);
            const float *k_new = qkv + (int64_t)hq * d, *v_new = qkv + (int64_t)(hq + hkv) * d;
            if (s->kv_bf16)
                cv_paged_attention_team_bf16(
                    qkv, qkv_w, attn, (int64_t)hq * d, (uint16_t *)L->k_cache,
                    (uint16_t *)L->v_cache, R->block_tables, R->bt_stride, R->key_begin,
                    R->key_end, R->rows, R->batch, R->n, hq, hkv, d, s->block_size, R->max_keys,
                    s->scale, k_new, qkv_w, v_new, qkv_w, s->slots, t, s->num_slots,
                    &attn_failed);
            else
                cv_paged_attention_team_f32(
                    qkv, qkv_w, attn, (int64_t)hq * d, (float *)L->k_cache, (float *)L->v_cache,
                    R->block_tables, R->bt_stride, R->key_begin, R->key_end, R->rows, R->batch,
                    R->n, hq, hkv, d, s->block_size, R->max_keys, s->scale, k_new, qkv_w, v_new,
                    qkv_w, s->slots, t, s->num_slots, &attn_failed);
            if (attn_failed) {
                code = (i << 8) | (attn_failed << 1);
                break;
            }
            if (run_linear(&L->o, attn, t, o, xq, s->passes)) {
                code = (i << 8) | 1;
                break;
            }
            cv_add_rms_norm_team(o, hidden, residual, hidden, L->post_norm, t, hidden,
                                 L->post_eps);
            if (run_linear(&L->gate_up, o, t, gate_up, xq, s->passes)) {
                code = (i << 8) | 1;
                break;
            }
            cv_silu_mul_team(gate_up, 2 * (int64_t)s->inter, act, s->inter, t, s->inter);
            if (run_linear(&L->down, act, t, x, xq, s->passes)) {
                code = (i << 8) | 1;
                break;
            }
        }
        if (!code)
            cv_add_rms_norm_team(x, hidden, residual, hidden, s->final_norm, t, hidden,
                                 s->final_eps);
        #pragma omp master
        status = code;
    }
    return status;
}

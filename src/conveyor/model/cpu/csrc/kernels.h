/* The one internal header of the CPU kernels: every C file of csrc includes it. It says which
 * instruction sets this build may use, holds the types the files share (and Python mirrors),
 * and declares every function one file calls in another or Python calls through ctypes. It
 * holds no code: the inline helpers are vec_math.h's and quant_simd.h's, the layouts
 * quant_layout.h's and gemm_panels.h's.
 *
 * Names follow one grammar, `<op>_<weight type>_<activation type>[_<form>][_<isa>]`:
 *
 *   op          gemm, dot, rows, dequantize, panel, paged_attention, attend, rms_norm, ...
 *   weight      f32, bf16, q4_0, q4_1, q8_0, mxfp4, q4_k, q5_k, q6_k; gguf where the GGUF
 *               type is an argument (dispatched through quant_types.c's table); none for ops
 *               without one (rotary_f32, argmax_f32; quantize_q8a_f32 names its output, q8a,
 *               there)
 *   activation  f32, bf16 (x rounded to bf16: vdpbf16ps), q8a (8-bit blocks of 32)
 *   form        team (every thread of a running parallel region calls it; it returns after
 *               the team's barrier), team_nowait, own (the calling thread alone), grouped
 *               (the panel group is an argument)
 *   isa         avx512, avx2, avx512bf16 or generic (the plain C fallback, compiled in every
 *               build): a variant in a file of its own (quant_k_avx2.c, gemm_avx512.c, ...)
 *
 * (static helpers inside one file are named for what they do).
 *
 * The library is compiled with -fvisibility=hidden: only CONVEYOR_EXPORT functions are its
 * ctypes-facing symbols (cpu_kernels.SIGNATURES), the rest bind inside it. */
#ifndef CONVEYOR_KERNELS_H
#define CONVEYOR_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#define CONVEYOR_EXPORT __attribute__((visibility("default")))

/* ---- What the compiler may use (-march=native: this CPU's features; CONVEYOR_CPU_ISA forces
 * a lower level, cpu_build.py). A variant's file compiles under its macro. */
#if defined(__AVX2__) && defined(__FMA__)
#define CONVEYOR_AVX2 1 /* the 6 x 16 GEMM, the attention, argmax and silu vector loops */
#if defined(__AVX512F__)
#define CONVEYOR_GEMM512 1 /* the zmm GEMM */
#if defined(__AVX512BF16__)
#define CONVEYOR_DPBF16 1 /* bf16 panels through vdpbf16ps */
#endif
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CONVEYOR_AVX512 1 /* 512-bit block dot products and activation quantization */
#if defined(__AVX512BF16__)
#define CONVEYOR_QUANT_PANELS 1 /* GGUF groups dequantized into bf16 panels */
#endif
#endif
#endif
/* The GGUF dot products' variant: 512-bit tiles, else 256-bit one row at a time (both need
 * F16C for their scales), else plain C. */
#if defined(CONVEYOR_AVX512) && defined(__F16C__)
#define CONVEYOR_QUANT_AVX512 1
#elif defined(CONVEYOR_AVX2) && defined(__F16C__)
#define CONVEYOR_QUANT_AVX2 1
#endif

/* ---- GGUF blocks (quant_layout.h has the interleaved layouts) */
#define QK 32    /* weights per activation block (and per Q8_0 / Q4_0 / Q4_1 / MXFP4 block) */
#define QK_K 256 /* weights per K-quant super-block */
/* Weight rows per interleaved group (quant_linear.py's interleave_groups): one 512-bit
 * register holds four consecutive quants of each of the sixteen rows, one int32 lane a row. */
#define QG 16
/* Activation rows per tile: the most rows of x one pass over a group's unpacked weights
 * serves (the dot products take 1 .. QT). */
#define QT 4
/* Blocks (rows x weights / 32) from which a quantization or a dot product takes a team. */
#define QUANT_PARALLEL_MIN_BLOCKS 4096

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 }; /* GGML's ids */

typedef struct {
    float d, s; /* scale, and d * sum(q) */
    int8_t q[QK];
} q8a_block; /* 40 bytes: one block of 32 activations */

_Static_assert(sizeof(q8a_block) == 40, "q8a_block layout");

/* A group's QG dot products with `rows` (1 .. QT) activation rows of k / 32 blocks, ldx
 * blocks apart (x2: their second pass, or NULL; xsum: the activation sums below, NULL for
 * types without), out[r * QG + i] for activation row r and weight row i. */
typedef void (*quant_dot_fn)(const uint8_t *w, int64_t k, const q8a_block *x,
                             const q8a_block *x2, int64_t ldx, int rows, const int32_t *xsum,
                             float *out);
/* Row r (< QG) of a group, k weights, dequantized to float32. */
typedef void (*quant_row_fn)(const uint8_t *w, int r, int64_t k, float *out);
/* A group's sixteen rows as one bf16 panel [k / 2][16][2] (gemm.c's layout), the weights
 * those of the row function rounded to nearest even. */
typedef void (*quant_panel_fn)(const uint8_t *w, int64_t k, uint16_t *panel);

/* The activation sums a type's dot product starts its integer sums from (xsum: int32
 * [passes][m][k / 32][2], gemm_gguf_q8a fills them): Q6_K -32 times each half-block's sum of
 * 16 quants (its q - 32 offset), Q8_0 -128 times the block's sum of 32 (its weights are
 * stored + 128, unsigned for dpbusd) and 0, MXFP4 -12 times it and 0 (its values looked up
 * + 12, unsigned for dpbusd and maddubs). */
enum { XSUM_NONE, XSUM_Q8_0, XSUM_Q6_K, XSUM_MXFP4 };

/* One GGUF type the kernels keep quantized: quant_types.c's table, the one place a type id
 * leads to its code. */
typedef struct {
    int32_t id;          /* GGML's type id */
    int32_t block;       /* weights per block: QK, or QK_K for the K-quants */
    int64_t group_bytes; /* bytes per block of an interleaved group of QG rows */
    int32_t xsum;        /* XSUM_* */
    quant_dot_fn dot;    /* the build's variant */
    quant_row_fn dequantize;
    quant_panel_fn panel; /* NULL without CONVEYOR_QUANT_PANELS */
} quant_type;

/* The type `id` when these kernels take it at width k (whole blocks), else NULL: the one
 * check of every GGUF entry point. */
const quant_type *quant_type_of(int id, int64_t k);

/* ---- Paged attention (paged_attention.c): one step's query rows, and the rest of a call */
typedef struct {
    const int32_t *block_tables; /* [B, bt_stride]: row i's table is batch[i] */
    int64_t bt_stride;
    const int32_t *key_begin; /* [n] first key of row i, or NULL: 0 */
    const int32_t *key_end;   /* [n] one past its last key (> key_begin) */
    const int64_t *rows;      /* [n] the query rows attended */
    const int64_t *batch;     /* [n] each one's block table row */
    int64_t n;
    int32_t max_keys; /* >= every row's key count: sizes the work buffers */
} attention_rows;

typedef struct {
    const float *q; /* [*, Hq * D]: query row rows[i] at q + rows[i] * q_stride */
    int64_t q_stride;
    float *out; /* written at the same rows */
    int64_t out_stride;
    void *k_cache, *v_cache; /* [num_blocks, block_size, Hkv, D], float32 or bf16 */
    int32_t hq, hkv, d, block_size;
    float scale;
    int32_t num_threads; /* the entry point's team (a team form runs on its caller's) */
    const float *new_k;  /* [n_new, Hkv * D] rows written into the cache first */
    int64_t new_k_stride;
    const float *new_v;
    int64_t new_v_stride;
    const int64_t *slots; /* [n_new] their flat cache slots */
    int64_t n_new;
    int64_t num_slots;   /* num_blocks x block_size */
    const float *sinks;  /* [Hq] each query head's sink logit (gpt-oss), or NULL: none */
} attention_args;

/* ---- The fused decoder layers (decoder_layers.c; fused_layers.py mirrors them) */
#define MAX_PARTS 4

/* One linear layer: float32 or bfloat16 panels (CpuLinear) or GGUF blocks (QuantLinear, up
 * to MAX_PARTS pieces stacked by rows, each with its type). */
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
} linear_desc;

typedef struct {
    const float *in_norm, *post_norm;
    float in_eps, post_eps;
    int32_t rows_set; /* which of the step's attention row sets (its sliding window) */
    void *k_cache, *v_cache;
    linear_desc qkv, o, gate_up, down;
} layer_desc;

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
} step_desc;

/* ==== Entry points (ctypes) ==== */

/* paged_attention.c: 0, or a sum of 1 (no memory for the work buffers), 2 (a row's key range
 * empty or longer than max_keys), 4 (a new token's slot outside [0, num_slots)). */
CONVEYOR_EXPORT int paged_attention_f32_f32(const attention_rows *r, const attention_args *a);
CONVEYOR_EXPORT int paged_attention_bf16_f32(const attention_rows *r, const attention_args *a);
/* rms_norm.c, rotary.c, silu_mul.c, argmax.c */
CONVEYOR_EXPORT void add_rms_norm_f32_f32(float *x, int64_t x_stride, float *residual,
                                          int64_t r_stride, const float *w, int64_t rows,
                                          int hidden, float eps, int num_threads);
CONVEYOR_EXPORT void rms_norm_f32_f32(const float *x, int64_t x_stride, float *out,
                                      int64_t out_stride, const float *w, int64_t rows,
                                      int hidden, float eps, int num_threads);
CONVEYOR_EXPORT void rotary_f32(float *x, int64_t row_stride, int64_t rows, int num_heads, int d,
                                const int64_t *positions, const float *cos_sin, int num_threads);
CONVEYOR_EXPORT void silu_mul_f32(const float *gate_up, int64_t in_stride, float *out,
                                  int64_t out_stride, int64_t rows, int inter, int num_threads);
CONVEYOR_EXPORT void argmax_f32(const float *x, int64_t stride, int64_t rows, int64_t cols,
                                int64_t *out, int num_threads);
CONVEYOR_EXPORT int nonfinite_rows_f32(const float *x, int64_t stride, int64_t rows,
                                       int64_t cols, uint8_t *bad, int num_threads);
/* gemm.c: out = x @ W^T + bias on CpuLinear's panels (gemm_panels.h), on a team of
 * num_threads; _grouped: the panels in groups of `group` (quant_gemm.c's slices: 1). The
 * operands every GEMM takes: */
#define GEMM_OPERANDS(W_T)                                                                     \
    const float *x, int64_t ldx, int64_t m, const W_T *packed, int64_t n, int64_t k,           \
        const float *bias, float *out, int64_t ldo
CONVEYOR_EXPORT void gemm_f32_f32(GEMM_OPERANDS(float), int num_threads);
CONVEYOR_EXPORT void gemm_bf16_f32(GEMM_OPERANDS(uint16_t), int num_threads);
CONVEYOR_EXPORT void gemm_bf16_f32_grouped(GEMM_OPERANDS(uint16_t), int num_threads, int group);
#ifdef CONVEYOR_DPBF16
CONVEYOR_EXPORT void gemm_bf16_bf16(GEMM_OPERANDS(uint16_t), int num_threads);
CONVEYOR_EXPORT void gemm_bf16_bf16_grouped(GEMM_OPERANDS(uint16_t), int num_threads, int group);
#endif
/* Which GEMM this build has: 0 generic, 1 AVX2 + FMA, 2 AVX-512 (bf16 weights widened), 3
 * AVX-512 with bf16 panels through vdpbf16ps. */
CONVEYOR_EXPORT int gemm_isa(void);
/* Rows ids[i] of a packed W [n, k] as float32 (an embedding lookup in a tied head's panels):
 * 1 when an id is outside [0, n) (nothing written), else 0. */
CONVEYOR_EXPORT int rows_f32_f32(const float *packed, int64_t n, int64_t k, const int64_t *ids,
                                 int64_t count, float *out, int64_t ldo, int num_threads);
CONVEYOR_EXPORT int rows_bf16_f32(const uint16_t *packed, int64_t n, int64_t k,
                                  const int64_t *ids, int64_t count, float *out, int64_t ldo,
                                  int num_threads);
/* quantize.c, quant_linear.c, quant_gemm.c: GGUF blocks (quant_linear.py wraps them) */
CONVEYOR_EXPORT void quantize_q8a_f32(const float *x, int64_t ldx, int64_t m, int64_t k,
                                      void *out, int passes, int num_threads);
CONVEYOR_EXPORT int gemm_gguf_q8a(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                                  const void *xq, int64_t m, int passes, const float *bias,
                                  float *out, int64_t ldo, int num_threads, int max_tile);
CONVEYOR_EXPORT int rows_gguf_f32(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                                  const int64_t *ids, int64_t count, float *out, int64_t ldo,
                                  int num_threads);
#ifdef CONVEYOR_QUANT_PANELS
CONVEYOR_EXPORT int gemm_gguf_bf16(int qtype, const uint8_t *w, int64_t ldw, int64_t n,
                                   int64_t k, const float *x, int64_t ldx, int64_t m,
                                   const float *bias, float *out, int64_t ldo,
                                   int64_t slice_bytes, int num_threads);
#endif
/* decoder_layers.c: every decoder layer of a step in one call */
/* ---- A mixture of experts' feed-forward (moe.c; model/cpu/moe_kernel.py mirrors it) */
typedef struct {
    int64_t t;                    /* tokens */
    int32_t hidden, inter, top_k, num_experts, passes, num_threads;
    const float *x;               /* [t, hidden] */
    float *out;                   /* [t, hidden], zeroed by the caller, added into */
    const int64_t *topk_ids;      /* [t, top_k] */
    const float *topk_weights;    /* [t, top_k] */
    const linear_desc *gate_up;   /* [num_experts]: [gate | up] of each expert */
    const linear_desc *down;      /* [num_experts] */
    float *xg, *gate_up_out, *act, *y; /* scratch: [t, hidden], [t, 2 inter], [t, inter],
                                          [t, hidden] */
    void *xq;                     /* q8a scratch for t rows of max(hidden, inter) */
} moe_args;

/* Returns 0; 1: a quantized type the kernel does not handle; 3: out of memory; 4: an expert
 * id out of range. */
CONVEYOR_EXPORT int moe_f32(const moe_args *a);

CONVEYOR_EXPORT int decoder_layers_f32(const layer_desc *layers, int n_layers,
                                       const attention_rows *row_sets, const step_desc *s,
                                       float *x, float *residual, float *o, float *qkv,
                                       float *attn, float *gate_up, float *act, void *xq);

/* ==== Team forms: for a caller already running a parallel region (decoder_layers.c) ==== */

/* The attention's failure bits of every thread are ORed into *team_failed (shared, zero
 * before), which each thread may read on return. */
void paged_attention_f32_f32_team(const attention_rows *r, const attention_args *a,
                                  int *team_failed);
void paged_attention_bf16_f32_team(const attention_rows *r, const attention_args *a,
                                   int *team_failed);
void add_rms_norm_f32_f32_team(float *x, int64_t x_stride, float *residual, int64_t r_stride,
                               const float *w, int64_t rows, int hidden, float eps);
void rms_norm_f32_f32_team(const float *x, int64_t x_stride, float *out, int64_t out_stride,
                           const float *w, int64_t rows, int hidden, float eps);
/* No barrier at the end: the team's next static loop over as many rows completes it. */
void rotary_f32_team_nowait(float *x, int64_t row_stride, int64_t rows, int num_heads, int d,
                            const int64_t *positions, const float *cos_sin);
void silu_mul_f32_team(const float *gate_up, int64_t in_stride, float *out, int64_t out_stride,
                       int64_t rows, int inter);
/* gemm.c, on CpuLinear's groups of panels (gemm_bf16_bf16_team: DPBF16 builds only) */
void gemm_f32_f32_team(GEMM_OPERANDS(float));
void gemm_bf16_f32_team(GEMM_OPERANDS(uint16_t));
#ifdef CONVEYOR_DPBF16
void gemm_bf16_bf16_team(GEMM_OPERANDS(uint16_t));
#endif
/* quantize.c: m rows of x into passes x m rows of k / 32 blocks, the team splitting the rows;
 * _own: all by the calling thread, no barrier (into a buffer of quantize_q8a_own_bytes, 0
 * when that is more than a thread should hold on its stack). */
void quantize_q8a_f32_team(const float *x, int64_t ldx, int64_t m, int64_t k, void *out,
                           int passes);
void quantize_q8a_f32_own(const float *x, int64_t ldx, int64_t m, int64_t k, void *out,
                          int passes);
size_t quantize_q8a_own_bytes(int64_t m, int64_t k, int passes);
/* decoder_layers.c: one linear_desc through the team forms (1: a type it cannot run). */
int linear_f32_team(const linear_desc *l, const float *x, int64_t m, float *out, void *xq,
                    int passes);
/* quant_linear.c: own: xq is each thread's own copy (quantize_q8a_f32_own's). */
int gemm_gguf_q8a_team(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                       const void *xq, int64_t m, int passes, const float *bias, float *out,
                       int64_t ldo, int own);

/* ==== ISA variants, each in a file of its own; the dispatchers pick the build's ==== */

/* gemm_avx512.c, gemm_avx2.c, gemm_generic.c, gemm_avx512bf16.c: the team GEMMs on panels in
 * groups of `group` (PANEL_GROUP: CpuLinear's; 1: quant_gemm.c's slices). */
#define GEMM_TEAM_ARGS(W_T) GEMM_OPERANDS(W_T), int group
void gemm_f32_f32_team_generic(GEMM_TEAM_ARGS(float));
void gemm_bf16_f32_team_generic(GEMM_TEAM_ARGS(uint16_t));
#if defined(CONVEYOR_AVX2) && !defined(CONVEYOR_GEMM512)
void gemm_f32_f32_team_avx2(GEMM_TEAM_ARGS(float));
void gemm_bf16_f32_team_avx2(GEMM_TEAM_ARGS(uint16_t));
#endif
#ifdef CONVEYOR_GEMM512
void gemm_f32_f32_team_avx512(GEMM_TEAM_ARGS(float));
void gemm_bf16_f32_team_avx512(GEMM_TEAM_ARGS(uint16_t));
/* The calling thread's buffer for packed rows of x, grown as needed and kept (NULL when it
 * cannot grow); one for every AVX-512 GEMM. */
void *gemm_pack_buffer(size_t bytes);
#endif
#ifdef CONVEYOR_DPBF16
void gemm_bf16_bf16_team_avx512bf16(GEMM_TEAM_ARGS(uint16_t));
#endif

/* paged_attention_avx2.c: one (row, KV head) task, its G query heads at qh / oh over the
 * keys at slot[0 .. len) (d % 8 == 0); k, v point at this KV head's lane of the cache; sinks
 * at its G heads' sink logits, or NULL. */
#define ATTEND_ARGS(KV_T)                                                                      \
    const float *qh, float *oh, const KV_T *k, const KV_T *v, const int64_t *slot,             \
        int64_t stride, int len, int g, int d, float scale, const float *sinks, float *scores
#ifdef CONVEYOR_AVX2
void attend_f32_f32_avx2(ATTEND_ARGS(float));
void attend_bf16_f32_avx2(ATTEND_ARGS(uint16_t));
/* argmax_avx2.c: the first index of row x's maximum (n >= 16), or -1 when the row holds a
 * NaN (the caller's scalar loop finds it). silu_mul_avx2.c: o = silu(g) * u for the first
 * multiple of eight of n elements; returns how many. */
int64_t argmax_row_f32_avx2(const float *x, int64_t n);
int silu_mul_row_f32_avx2(const float *g, const float *u, float *o, int n);
#endif

/* quantize.c, quantize_avx512.c: row x [nb x 32] into nb blocks at o, and (o2 not NULL) its
 * rounding error into nb more at o2; bit for bit the same in either. */
void quantize_row_q8a_f32_generic(const float *x, int64_t nb, q8a_block *o, q8a_block *o2);
#ifdef CONVEYOR_AVX512
void quantize_row_q8a_f32_avx512(const float *x, int64_t nb, q8a_block *o, q8a_block *o2);
#endif

/* quant_x8_*.c (Q8_0, Q4_0, Q4_1, MXFP4) and quant_k_*.c (Q4_K, Q5_K, Q6_K): each type's dot
 * product (quant_dot_fn), row dequantization (quant_row_fn) and bf16 panel (quant_panel_fn);
 * quant_types.c's table holds them. */
#define QUANT_DOT_ARGS                                                                         \
    const uint8_t *w, int64_t k, const q8a_block *x, const q8a_block *x2, int64_t ldx,         \
        int rows, const int32_t *xsum, float *out
void dot_q4_0_q8a_generic(QUANT_DOT_ARGS);
void dot_q4_1_q8a_generic(QUANT_DOT_ARGS);
void dot_q8_0_q8a_generic(QUANT_DOT_ARGS);
void dot_mxfp4_q8a_generic(QUANT_DOT_ARGS);
void dot_q4_k_q8a_generic(QUANT_DOT_ARGS);
void dot_q5_k_q8a_generic(QUANT_DOT_ARGS);
void dot_q6_k_q8a_generic(QUANT_DOT_ARGS);
#ifdef CONVEYOR_QUANT_AVX2
void dot_q4_0_q8a_avx2(QUANT_DOT_ARGS);
void dot_q4_1_q8a_avx2(QUANT_DOT_ARGS);
void dot_q8_0_q8a_avx2(QUANT_DOT_ARGS);
void dot_mxfp4_q8a_avx2(QUANT_DOT_ARGS);
void dot_q4_k_q8a_avx2(QUANT_DOT_ARGS);
void dot_q5_k_q8a_avx2(QUANT_DOT_ARGS);
void dot_q6_k_q8a_avx2(QUANT_DOT_ARGS);
#endif
#ifdef CONVEYOR_QUANT_AVX512
void dot_q4_0_q8a_avx512(QUANT_DOT_ARGS);
void dot_q4_1_q8a_avx512(QUANT_DOT_ARGS);
void dot_q8_0_q8a_avx512(QUANT_DOT_ARGS);
void dot_mxfp4_q8a_avx512(QUANT_DOT_ARGS);
void dot_q4_k_q8a_avx512(QUANT_DOT_ARGS);
void dot_q5_k_q8a_avx512(QUANT_DOT_ARGS);
void dot_q6_k_q8a_avx512(QUANT_DOT_ARGS);
#endif
void dequantize_q4_0_f32(const uint8_t *w, int r, int64_t k, float *out);
void dequantize_q4_1_f32(const uint8_t *w, int r, int64_t k, float *out);
void dequantize_q8_0_f32(const uint8_t *w, int r, int64_t k, float *out);
void dequantize_mxfp4_f32(const uint8_t *w, int r, int64_t k, float *out);
void dequantize_q4_k_f32(const uint8_t *w, int r, int64_t k, float *out);
void dequantize_q5_k_f32(const uint8_t *w, int r, int64_t k, float *out);
void dequantize_q6_k_f32(const uint8_t *w, int r, int64_t k, float *out);
#ifdef CONVEYOR_QUANT_PANELS
void panel_q4_0_bf16(const uint8_t *w, int64_t k, uint16_t *panel);
void panel_q4_1_bf16(const uint8_t *w, int64_t k, uint16_t *panel);
void panel_q8_0_bf16(const uint8_t *w, int64_t k, uint16_t *panel);
void panel_mxfp4_bf16(const uint8_t *w, int64_t k, uint16_t *panel);
void panel_q4_k_bf16(const uint8_t *w, int64_t k, uint16_t *panel);
void panel_q5_k_bf16(const uint8_t *w, int64_t k, uint16_t *panel);
void panel_q6_k_bf16(const uint8_t *w, int64_t k, uint16_t *panel);
#endif

#endif

/* Paged attention for CPU, one query row at a time (q, out and the sums float32; the KV cache
 * float32 or bfloat16: paged_attention_f32_f32 / paged_attention_bf16_f32, paged_attention_kv.h
 * once each), read straight from the paged KV cache (no gather into a padded copy, no mask):
 * a decode token, or one token of a prefill chunk, whose keys are its own context
 * [key_begin, key_end). The arguments come in two structs (kernels.h): the step's rows
 * (attention_rows, checked once a step by cpu_kernels.attention_rows) and the rest
 * (attention_args).
 *
 * Built and loaded at run time by conveyor.model.cpu.cpu_kernels (cc -O3 -march=native -fopenmp);
 * its torch reference is conveyor.model.attention.torch_attention, which tests compare it against.
 *
 * Layout (conveyor.model.attention): the K (and V) cache of one layer is
 * [num_blocks, block_size, Hkv, D], contiguous; token position p of request b is at block
 * block_tables[b * bt_stride + p / block_size], offset p % block_size. Query head
 * x * G + g (G = Hq / Hkv) reads KV head x, so the G heads of one KV head are G consecutive
 * rows of D floats in q and in out: one task per (row, KV head) reads each K and V row of its
 * context from memory once and, from L1, for all G query heads.
 *
 *     scores[g][j] = scale * <q[g], K[j]>              key_begin <= j < key_end
 *     out[g]       = sum_j softmax_j(scores[g])[j] * V[j]
 *
 * With attention sinks (gpt-oss; attention_args.sinks not NULL), query head h's sink logit
 * joins the softmax's max m and its denominator only: + e^(sinks[h] - m).
 *
 * A prefill chunk's token i (position p) has key_end = p + 1: causal attention over the chunk
 * and the request's cached context, whose K/V the backend wrote before calling. The work is
 * the same as a causal SDPA's; the chunk's rows re-read the same K/V rows from cache.
 *
 * With AVX2 + FMA and D % 8 == 0 (every model we load) the three stages run eight lanes wide
 * (paged_attention_avx2.c). Otherwise the generic loop does the same sums.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec_math.h"

/* Rows read ahead: each task's K/V rows are 1 / Hkv of a token's cache line run and hop
 * between blocks, which the hardware prefetchers follow poorly
 * (docs/kernels.md#measured-choices). */
#define PREFETCH_AHEAD 2

/* float32 cache */
#define KV(name) name##_f32_f32
#define KV_FORM(name, form) name##_f32_f32_##form
#define KV_T float
#define TO_F32(x) (x)
#define STORE_ROW(dst, src, n) memcpy(dst, src, sizeof(float) * (size_t)(n))
#include "paged_attention_kv.h"
#undef KV
#undef KV_FORM
#undef KV_T
#undef TO_F32
#undef STORE_ROW

/* bfloat16 cache: half the bytes to read; widening is a shift, and each new value is rounded
 * to nearest even on its way in. */
static inline void store_row_bf16(uint16_t *dst, const float *src, int64_t n)
{
    for (int64_t e = 0; e < n; e++) dst[e] = f32_to_bf16(src[e]);
}

#define KV(name) name##_bf16_f32
#define KV_FORM(name, form) name##_bf16_f32_##form
#define KV_T uint16_t
#define TO_F32(x) bf16_to_f32(x)
#define STORE_ROW(dst, src, n) store_row_bf16(dst, src, n)
#include "paged_attention_kv.h"
#undef KV
#undef KV_FORM
#undef KV_T
#undef TO_F32
#undef STORE_ROW

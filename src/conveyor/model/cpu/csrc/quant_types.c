/* The GGUF types the kernels keep quantized, in one table: a type id leads here to its block
 * size, its interleaved group's bytes, the activation sums its dot product takes, and its
 * functions: the build's variant of the dot product (quant_*_avx512.c, quant_*_avx2.c, else
 * quant_*_generic.c), the row dequantization and, with AVX512-BF16, the bf16 panel. A new
 * type is one row here, its functions in quant_x8_*.c or quant_k_*.c (kernels.h declares
 * them), and its layout in quant_layout.h. */
#include "kernels.h"
#include "quant_layout.h"

#if defined(CONVEYOR_QUANT_AVX512)
#define DOT(t) dot_##t##_q8a_avx512
#elif defined(CONVEYOR_QUANT_AVX2)
#define DOT(t) dot_##t##_q8a_avx2
#else
#define DOT(t) dot_##t##_q8a_generic
#endif
#ifdef CONVEYOR_QUANT_PANELS
#define PANEL(t) panel_##t##_bf16
#else
#define PANEL(t) 0
#endif
#define TYPE(ID, t, BLOCK, BYTES, XSUM)                                                        \
    {ID, BLOCK, BYTES, XSUM, DOT(t), dequantize_##t##_f32, PANEL(t)}

static const quant_type TYPES[] = {
    TYPE(Q4_0, q4_0, QK, Q4_0_GROUP_BYTES, XSUM_NONE),
    TYPE(Q4_1, q4_1, QK, Q4_1_GROUP_BYTES, XSUM_NONE),
    TYPE(Q8_0, q8_0, QK, Q8_0_GROUP_BYTES, XSUM_Q8_0),
    TYPE(MXFP4, mxfp4, QK, MXFP4_GROUP_BYTES, XSUM_MXFP4),
    TYPE(Q4_K, q4_k, QK_K, Q4_K_GROUP_BYTES, XSUM_NONE),
    TYPE(Q5_K, q5_k, QK_K, Q5_K_GROUP_BYTES, XSUM_NONE),
    TYPE(Q6_K, q6_k, QK_K, Q6_K_GROUP_BYTES, XSUM_Q6_K),
};

const quant_type *quant_type_of(int id, int64_t k)
{
    for (size_t i = 0; i < sizeof TYPES / sizeof *TYPES; i++)
        if (TYPES[i].id == id) return k % TYPES[i].block == 0 ? TYPES + i : 0;
    return 0;
}

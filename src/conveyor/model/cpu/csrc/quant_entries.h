/* The entry points of one family of GGUF types (quant_x8_*.c: Q4_0, Q4_1, Q8_0; quant_k_*.c:
 * Q4_K, Q5_K, Q6_K), each a call of the file's kernel written once for the family's types:
 * every quant_x8_*.c and quant_k_*.c includes this file once after defining
 *
 *   QUANT_TYPES(X)  the family, X(t, TYPE) a type: X8_TYPES or K_TYPES (quant_layout.h)
 *
 * and what it has of
 *
 *   DOT_ISA         the dot products' suffix, dot_<t>_q8a_<DOT_ISA>, and how they split a
 *                   call's activation rows: avx512 in one tile (its height T a constant in
 *                   each copy), avx2 a row at a time, generic all in one call
 *   TILE(TYPE, T, x, x2, out)  the dot kernel for T activation rows from x (x2: their second
 *                   pass, or NULL: a constant in each avx512 copy; avx2 splits it itself)
 *                   into out; it may read the entry point's w, k, ldx and xsum
 *   DEQUANTIZE(TYPE, w, r, k, out)  row r of a group: dequantize_<t>_f32 (quant_row_fn)
 *   TO_PANEL(TYPE, w, k, panel)     a group as a bf16 panel: panel_<t>_bf16 (quant_panel_fn)
 *
 * which it undefines. The kernels are static inline: each entry point holds its own copy,
 * with the type (and the tile height and pass count) constant, so their loops carry no
 * branches on them. kernels.h declares the entry points; quant_types.c's table holds them.
 */
#define QE_CAT_(a, b) a##b
#define QE_CAT(a, b) QE_CAT_(a, b)

#ifdef DOT_ISA
/* The rows a TILE takes: all of them (up to QT), one or all (T not a constant). */
#define TILE_ROWS_avx512 QT
#define TILE_ROWS_avx2 1
#define TILE_ROWS_generic 0
#define TILE_ROWS QE_CAT(TILE_ROWS_, DOT_ISA)
/* x2 NULL or not, each its own copy */
#define TILE_PASSES(TYPE, T, x_, x2_, out_)                                                    \
    do {                                                                                       \
        if (x2_) {                                                                             \
            TILE(TYPE, T, x_, x2_, out_);                                                      \
        } else {                                                                               \
            TILE(TYPE, T, x_, 0, out_);                                                        \
        }                                                                                      \
    } while (0)

static inline __attribute__((always_inline)) void dots(const int qtype, QUANT_DOT_ARGS)
{
    (void)w, (void)k, (void)ldx, (void)xsum; /* the kernel's, if it reads them */
#if TILE_ROWS == QT
    _Static_assert(QT == 4, "tiles of 1 .. 4 rows");
    switch (rows) {
    case 1: TILE_PASSES(qtype, 1, x, x2, out); break;
    case 2: TILE_PASSES(qtype, 2, x, x2, out); break;
    case 3: TILE_PASSES(qtype, 3, x, x2, out); break;
    default: TILE_PASSES(qtype, 4, x, x2, out); break;
    }
#elif TILE_ROWS == 1
    for (int t = 0; t < rows; t++) {
        const q8a_block *xt = x + t * ldx, *yt = x2 ? x2 + t * ldx : 0;
        TILE(qtype, 1, xt, yt, out + QG * t);
    }
#else
    TILE(qtype, rows, x, x2, out);
#endif
}

#define DOT_ENTRY(t, TYPE)                                                                     \
    void QE_CAT(QE_CAT(dot_, t), QE_CAT(_q8a_, DOT_ISA))(QUANT_DOT_ARGS)                       \
    {                                                                                          \
        dots(TYPE, w, k, x, x2, ldx, rows, xsum, out);                                         \
    }
QUANT_TYPES(DOT_ENTRY)
#undef DOT_ENTRY
#undef TILE_PASSES
#undef TILE_ROWS_avx512
#undef TILE_ROWS_avx2
#undef TILE_ROWS_generic
#undef TILE_ROWS
#endif

#ifdef DEQUANTIZE
#define ROW_ENTRY(t, TYPE)                                                                     \
    void dequantize_##t##_f32(const uint8_t *w, int r, int64_t k, float *out)                  \
    {                                                                                          \
        DEQUANTIZE(TYPE, w, r, k, out);                                                        \
    }
QUANT_TYPES(ROW_ENTRY)
#undef ROW_ENTRY
#endif

#ifdef TO_PANEL
#define PANEL_ENTRY(t, TYPE)                                                                   \
    void panel_##t##_bf16(const uint8_t *w, int64_t k, uint16_t *panel)                        \
    {                                                                                          \
        TO_PANEL(TYPE, w, k, panel);                                                           \
    }
QUANT_TYPES(PANEL_ENTRY)
#undef PANEL_ENTRY
#endif

#undef QE_CAT_
#undef QE_CAT
#undef QUANT_TYPES
#undef DOT_ISA
#undef TILE
#undef DEQUANTIZE
#undef TO_PANEL

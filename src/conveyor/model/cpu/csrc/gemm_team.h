/* The loops of the vector GEMMs, written once: gemm_avx2.c, gemm_avx512.c and
 * gemm_avx512bf16.c include this file once per weight form after defining
 *
 *   GEMM_TEAM    the function's name (gemm_f32_f32_team_avx2, gemm_bf16_bf16_team_avx512bf16)
 *   W_FORM       W_F32 (float32 panels: a line a k), W_BF16 (bf16 pairs widened to float32 one
 *                k at a time: a line per two k) or W_PAIRS (bf16 pairs taken as pairs by
 *                vdpbf16ps: a line a step)
 *   GEMM_MICROS  the instruction set's micro-kernels, a header included here once per form
 *
 * and undefines them afterwards. The loops step through k in what the micro-kernels take (k,
 * or pairs of k: K_STEPS), KC steps to a block. The micro-kernel header sees the macros
 * below (W_T, K_PER_LINE, LINE_AT, ...) and defines, for the loops:
 *
 *   X_PACKED     1: x's rows are packed first (X_T words, pack_block), 0: read where they are
 *   AHEAD_PREFETCH  1: a panel's second row block prefetches what the next first one reads
 *                (`ahead`, `ahead_kb` lines of it)
 *   FEW_ROWS(mb)    whether a block of mb rows takes a group's panels at a time
 *   FEW_WIDE, FEW_ONE  a few rows times a whole group's WIDE_P panels, or times one panel
 *   BLOCK        the MR rows (`rows` of them) from row r of the block times one panel
 *
 * (the calls read the loops' locals by name: x, ldx, ldo, m0, mb, xb, xs, kl, k0, kb, panel,
 * qs, pstride, pbias, o, cols, r, rows). The file that includes it may define
 * X_MISSING (what a team does when the packed rows' buffer could not grow), FEW_FIRST (a
 * path for a few rows taken before FEW_ROWS') and TILES (the long blocks' first panels: it
 * returns the first panel left to the blocks). Panels sit in groups (panel_line0, panel_qs in
 * gemm_panels.h): a panel's consecutive lines are qs elements apart, the group's panels one
 * line apart (one panel per group: qs is a line). What the kernels do and why is in gemm.c.
 */
#if W_FORM == W_F32
#define W_T float
#define SUFFIX _f32
#define K_STEPS(k) (k)
#define LINES(k) (k)
#define K_PER_LINE 1
#define LINE_AT(panel, kk, qs) ((panel) + (kk) * (qs))
#define W_SPLIT 0 /* float32 groups are never split */
#elif W_FORM == W_BF16
#define W_T uint16_t
#define SUFFIX _bf16
#define K_STEPS(k) (k)
#define LINES(k) (((k) + ((k) & 1)) / 2)
#define K_PER_LINE 2
#define LINE_AT(panel, kk, qs) ((panel) + ((kk) >> 1) * (qs))
#define W_SPLIT SPLIT_BF16 /* CpuLinear's layout for this build's bf16 panels */
#else
#define W_T uint16_t
#define SUFFIX _dp
#define K_STEPS(k) (((k) + 1) / 2)
#define LINES(k) (((k) + 1) / 2)
#define K_PER_LINE 1
#define LINE_AT(panel, kk, qs) ((panel) + (kk) * (qs))
#define W_SPLIT SPLIT_BF16
#endif
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define LINE_ELEMS (64 / (int64_t)sizeof(W_T))
/* The micro-kernels' names (static, one set per form) */
#define MICRO_FN(R) CAT(CAT(micro, R), SUFFIX)
#define MICROS_TABLE CAT(micros, SUFFIX)
#define WIDE_FN(R) CAT(CAT(wide, R), SUFFIX)
#define WIDES_TABLE CAT(wides, SUFFIX)

#include GEMM_MICROS

/* out[m, n] = x[m, k] . W^T + bias (bias may be NULL), the panels in groups of `group`
 * (PANEL_GROUP, or 1). Every thread of the running parallel region's team calls it (one
 * thread alone where the work is too small to split): the threads split the panels, and it
 * returns after the team's barrier (gemm.c's entry points, or decoder_layers.c's one region). */
void GEMM_TEAM(GEMM_TEAM_ARGS(W_T))
{
    const int64_t panels = (n + NR - 1) / NR, lines = LINES(k), kl = K_STEPS(k);
#if X_PACKED
    /* x's block of rows packed once for every panel, by one thread into its buffer (NULL:
     * X_MISSING); a few short rows (a decode step) by each thread into a buffer of its own on
     * its stack, so the team meets once, at the end */
    const size_t block_rows = (size_t)((m < MC ? m : MC) + MR - 1) / MR * MR;
    const int own = m <= WIDE2_R && m * kl <= OWN_PACK_WORDS;
    X_T own_xb[own ? m * kl : 1];
    X_T *xb = own_xb;
    if (!own) {
        #pragma omp single copyprivate(xb)
        xb = gemm_pack_buffer(block_rows * (size_t)(kl > 0 ? kl : 1) * sizeof(X_T));
    }
#ifdef X_MISSING
    X_MISSING
#endif
#endif
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mb = m - m0 < MC ? m - m0 : MC;
#if X_PACKED
        /* a few rows side by side (one row's k contiguous), more in blocks of MR */
        const int64_t xs = mb <= WIDE2_R ? mb : MR;
        pack_block(x + m0 * ldx, ldx, mb, k, xb, xs, own);
#endif
#ifdef FEW_FIRST
        FEW_FIRST
#endif
        if (FEW_ROWS(mb)) {
            const int64_t groups = (panels + WIDE_P - 1) / WIDE_P;
            #pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t p0 = g * WIDE_P;
                const int64_t np = panels - p0 < WIDE_P ? panels - p0 : WIDE_P;
                /* a whole group's four panels at once (not a middle group stored as two halves,
                 * gemm_panels.h's split_group: its panels one at a time) */
                const int whole = np == WIDE_P && !split_group(g, panels, group, W_SPLIT);
                for (int64_t k0 = 0; k0 == 0 || k0 < kl; k0 += KC) { /* K = 0: the bias */
                    const int64_t kb = kl - k0 < KC ? kl - k0 : KC;
                    for (int64_t p = p0; p < p0 + np; p += (whole ? WIDE_P : 1)) {
                        const int64_t last = whole ? p + WIDE_P - 1 : p;
                        const int cols = (int)(n - last * NR < NR ? n - last * NR : NR);
                        const int64_t qs = panel_qs(p, panels, group, W_SPLIT) * LINE_ELEMS;
                        const int64_t line0 = panel_line0(p, lines, panels, group, W_SPLIT);
                        const W_T *panel = LINE_AT(packed + line0 * LINE_ELEMS, k0, qs);
                        const float *pbias = bias ? bias + p * NR : 0;
                        float *o = out + m0 * ldo + p * NR;
                        /* one group (WIDE_P is PANEL_GROUP), or panels one to a group */
                        const int64_t pstride = (group == 1 ? lines : 1) * LINE_ELEMS;
                        if (whole)
                            FEW_WIDE
                        else
                            FEW_ONE
                    }
                }
            }
            continue;
        }
#ifdef TILES
        const int64_t p_first = TILES();
#else
        const int64_t p_first = 0;
#endif
        #pragma omp for schedule(static)
        for (int64_t p = p_first; p < panels; p++) {
            const int cols = (int)(n - p * NR < NR ? n - p * NR : NR);
            const float *pbias = bias ? bias + p * NR : 0;
            float *o = out + m0 * ldo + p * NR;
            const int64_t qs = panel_qs(p, panels, group, W_SPLIT) * LINE_ELEMS;
            const W_T *first_line =
                packed + panel_line0(p, lines, panels, group, W_SPLIT) * LINE_ELEMS;
            for (int64_t k0 = 0; k0 == 0 || k0 < kl; k0 += KC) { /* K = 0: the bias */
                const int64_t kb = kl - k0 < KC ? kl - k0 : KC;
                /* k0 is a multiple of KC, so even: a whole pair in bf16's layout */
                const W_T *panel = LINE_AT(first_line, k0, qs);
                for (int64_t r = 0; r < mb; r += MR) {
                    const int rows = (int)(mb - r < MR ? mb - r : MR);
#if AHEAD_PREFETCH
                    /* The second row block (7 rows or more) prefetches what the next first one
                     * reads first (the next block of this panel, or the next panel's first),
                     * so the weights stream while it computes. */
                    const W_T *ahead = 0;
                    int64_t ahead_kb = 0;
                    const int fetch = r == MR;
                    if (fetch && k0 + KC < kl) {
                        ahead = LINE_AT(first_line, k0 + KC, qs);
                        ahead_kb = kl - k0 - KC < KC ? kl - k0 - KC : KC;
                    } else if (fetch && p + 1 < panels &&
                               panel_qs(p + 1, panels, group, W_SPLIT) * LINE_ELEMS == qs) {
                        ahead =
                            packed + panel_line0(p + 1, lines, panels, group, W_SPLIT) * LINE_ELEMS;
                        ahead_kb = kl < KC ? kl : KC;
                    }
#endif
                    BLOCK
                }
            }
        }
    }
}

#undef W_T
#undef SUFFIX
#undef K_STEPS
#undef LINES
#undef K_PER_LINE
#undef LINE_AT
#undef W_SPLIT
#undef CAT_
#undef CAT
#undef LINE_ELEMS
#undef MICRO_FN
#undef MICROS_TABLE
#undef WIDE_FN
#undef WIDES_TABLE
#undef X_PACKED
#undef X_T
#undef AHEAD_PREFETCH
#undef FEW_ROWS
#undef FEW_WIDE
#undef FEW_ONE
#undef BLOCK

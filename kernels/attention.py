"""Paged attention over one flat varlen batch: prefill chunks and decode tokens in one launch.

Request b owns rows qsl[b] .. qsl[b+1]-1 of q (qsl = query_start_loc); they sit at positions
ctx_b .. seq_len_b - 1 (ctx_b = seq_len_b - q_len_b tokens were cached before) and attend
causally to keys 0 .. their own position, read from the paged cache through block_tables[b];
with a sliding window W (WINDOW > 0) the token at position p sees keys p - W + 1 .. p only,
and a query block starts at the tile holding its first token's first key.

Program (qb, kvh, split) = one query block x one KV head x one slice of the keys.
A query block holds BLOCK_Q consecutive new tokens of ONE request; its BLOCK_M rows are the
(token, query head) pairs of the GROUP query heads that share KV head kvh, so each K/V tile
loaded serves all of them (GQA packing; a decode token alone still fills GROUP rows):

    GROUP = 4, BLOCK_M = 16 -> BLOCK_Q = 4      row m -> token m // GROUP,
    rows   0 1 2 3 | 4 5 6 7 | 8 ... 15                head  kvh * GROUP + m % GROUP
    token  0 0 0 0 | 1 1 1 1 | 2 ...  3

Request b's query blocks are numbered from  qsl[b] // BLOCK_Q + b : increasing in b, with room
for its ceil(q_len_b / BLOCK_Q) blocks, so a grid of T // BLOCK_Q + B blocks covers every
request without a device-to-host sync; a program finds its request by binary search over qsl,
and blocks past the end of a request exit at once.

Keys are walked in tiles of TILE_N with an online softmax (exp2, running max m, running sum l,
unnormalised accumulator); no attention matrix is materialised. Each key's block id is read
from the block table, so a tile may span cache blocks of any size. With NUM_SPLITS > 1 (long
contexts but too few programs to fill the GPU) each program walks 1/NUM_SPLITS of its keys and
writes (acc, m, l) to fp32 scratch; `_reduce_splits_kernel` merges them.

Attention sinks (gpt-oss; SINKS): each query head's sink logit joins the running max and the
sum l once the keys are done (in the reduce kernel when the keys are split), adding no value.

int8 cache: K/V hold int8 with one fp32 scale per (token, head); K's scale multiplies the
scores of its column (exact, and cheaper than dequantising the tile), V is dequantised.
bf16 is computed in fp32 under the interpreter (its bf16 arithmetic is wrong); on a GPU fp16
and bf16 feed tl.dot directly with fp32 accumulation, and fp32 uses IEEE (not tf32) dots.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs

from conveyor.kernels._checks import check, check_kv_cache_dtype

LOG2E = 1.4426950408889634
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_MAX_SPLITS = 16


@triton.jit
def _find_request(qsl_ptr, qb, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with qsl[b] // BLOCK_Q + b <= qb (binary search; b < num_seqs)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= qb:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, cache_ptr, scales_ptr, tables_ptr, seq_lens_ptr, qsl_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr,
    qk_scale, num_seqs,
    s_qt, s_qh, s_ot, s_oh, s_ckv, s_cblk, s_cslot, s_chead,
    s_skv, s_sblk, s_sslot, s_shead, s_table,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    QUANT: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_request(qsl_ptr, qb, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    first_tok = (qb - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # within the request
    if first_tok >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    tok = first_tok + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + row[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(COMPUTE)

    # Causal: the block's last token sees keys 0 .. ctx + last; with a window its first token
    # sees nothing before ctx + first - WINDOW + 1. Its tiles are split evenly.
    kv_len = ctx + tl.minimum(first_tok + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    # WINDOW is a constexpr: one compiled variant per window size (usually <= 2 per model).
    tile_first = tl.maximum(ctx + first_tok - WINDOW + 1, 0) // TILE_N if WINDOW > 0 else 0
    tiles_per_split = tl.cdiv(num_tiles - tile_first, NUM_SPLITS)
    tile_lo = tile_first + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * s_table
    for j in range(tile_lo, tile_hi):
        offs_n = j * TILE_N + tl.arange(0, TILE_N)
        n_ok = offs_n < kv_len
        blk = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        kv_off = blk * s_cblk + slot * s_cslot + kvh * s_chead  # [TILE_N], K side
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision=PRECISION)  # [BLOCK_M, TILE_N]
        v = tl.load(cache_ptr + s_ckv + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = v.to(tl.float32) if QUANT else v.to(COMPUTE)
        if QUANT:
            sc_off = blk * s_sblk + slot * s_sslot + kvh * s_shead
            k_scale = tl.load(scales_ptr + sc_off, mask=n_ok, other=0.0)
            v_scale = tl.load(scales_ptr + s_skv + sc_off, mask=n_ok, other=0.0)
            s = s * k_scale[None, :]
            v = (v * v_scale[:, None]).to(COMPUTE)
        visible = row_ok[:, None] & (offs_n[None, :] <= (ctx + tok)[:, None])
        if WINDOW > 0:
            visible = visible & (offs_n[None, :] > (ctx + tok - WINDOW)[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        if SINKS:  # the sink (in exp2 units) joins the max and the sum
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            sink = sink * 1.4426950408889634  # LOG2E
            m_sink = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_sink)
            l_i = l_i * alpha + tl.exp2(sink - m_sink)
            acc = acc * alpha[:, None]
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + row[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Scratch [T, Hq, NUM_SPLITS, D_PAD] and [T, Hq, NUM_SPLITS], contiguous fp32.
        part = (row * NUM_Q_HEADS + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        a_ptrs = part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :]
        tl.store(a_ptrs, acc, mask=row_ok[:, None])


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, s_ot, s_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """One program per (token, query head): merge the splits' softmax states."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, D_PAD)
    part = (t * NUM_Q_HEADS + h) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + part)  # -inf for a split with no keys
    l_s = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :])
    m_max = tl.max(m, axis=0)  # finite: every row sees at least its own key
    if SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634  # LOG2E
        m_max = tl.maximum(m_max, sink)
    w = tl.exp2(m - m_max)
    denom = tl.sum(l_s * w, axis=0)
    if SINKS:
        denom += tl.exp2(sink - m_max)
    out = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(out_ptr + t * s_ot + h * s_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)  # fmt: skip


def _tiling(
    group: int, max_query_len: int, dtype: torch.dtype, quant: bool = False
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N, num_warps), as `benchmarks/attention.py --tile-sweep`
    picked them on an H200 (docs/kernels.md#tiles-timed-on-an-h200-2026-12-04). Decode: 16
    rows (tl.dot's minimum) x 64 keys on 4 warps; an int8 cache 16 x 128 (its dequantisation
    wants longer tiles). With prefill chunks: 64 x 64 on 4 warps. fp32 keeps 32 x 16 (wider
    tiles spill)."""
    if max_query_len == 1:
        rows, tile_n, warps = 16, 128 if quant else 64, 4
    elif dtype == torch.float32:
        rows, tile_n, warps = 32, 16, 4
    else:
        rows, tile_n, warps = 64, 64, 4
    block_m = max(rows, triton.next_power_of_2(group))
    return block_m, block_m // group, tile_n, warps


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(device: torch.device, programs: int, max_seq_len: int, tile_n: int) -> int:
    """Split the keys when the grid is too small to fill the GPU (decode of few requests)."""
    if device.type != "cuda":
        return 1
    target = 4 * _num_sms(device.index if device.index is not None else 0)
    splits = 1
    # Double while the grid is short of the target and each split keeps >= 4 tiles.
    while splits < _MAX_SPLITS and programs * splits < target:
        if max_seq_len < 8 * splits * tile_n:
            break
        splits *= 2
    return splits


def _compute_dtype(dtype: torch.dtype) -> tl.dtype:
    """What tl.dot sees: the input dtype, but fp32 for bf16 under the interpreter (its bf16
    arithmetic and bf16 dots give garbage)."""
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not knobs.runtime.interpret:
        return tl.bfloat16
    return tl.float32


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    kv_scales: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: int | None = None,
    tuning: tuple[int, int, int] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention for one mixed prefill/decode varlen batch (K/V already cached).

    Args:
        q: [T, Hq, D] fp16/bf16/fp32, last dim contiguous; Hq a multiple of Hkv.
        kv_cache: [2 (k|v), num_blocks, block_size, Hkv, D], q's dtype (or int8 with
            kv_scales), last dim contiguous; block_size a power of 2 in [8, 128].
        block_tables: int32 [B, max_blocks]; seq_lens: int32 [B] (context after this step);
        query_start_loc: int32 [B+1] cumulative new-token counts (T at the end).
        scale: softmax scale.
        max_query_len, max_seq_len: host copies of the largest q_len and seq_len.
        kv_scales: fp32 [2, num_blocks, block_size, Hkv] when kv_cache is int8.
        num_splits: key splits per query block (a power of 2 <= 16; None: by grid size).
        window: sliding window (position p sees keys p - window + 1 .. p); None: all keys.
        tuning: (TILE_N, num_warps, num_stages) in place of `_tiling`'s and the default 2
            stages (benchmarks/attention.py --tile-sweep); None: the defaults.
        sinks: [Hq] each query head's sink logit, contiguous (gpt-oss): it joins the
            softmax's max and denominator only; None: none.
    Returns:
        [T, Hq, D] in q's dtype.
    """
    check(q.dim() == 3 and kv_cache.dim() == 5, "q must be [T, Hq, D], kv_cache 5-D.")
    t, hq, d = q.shape
    two, _, block_size, hkv, d_cache = kv_cache.shape
    check(two == 2 and d_cache == d, f"kv_cache {tuple(kv_cache.shape)} does not fit q's D={d}.")
    check(hq % hkv == 0, f"{hq} query heads are not a multiple of {hkv} KV heads.")
    check(16 <= d <= 256, f"head size must be in [16, 256], got {d}.")
    check(block_size in (8, 16, 32, 64, 128), f"block size must be 8..128, got {block_size}.")
    check(q.dtype in _FLOATS, f"q must be fp16, bf16 or fp32, got {q.dtype}.")
    check(q.stride(2) == 1 and kv_cache.stride(4) == 1, "q and kv_cache need a contiguous D.")
    quant = check_kv_cache_dtype(kv_cache, kv_scales, q, "q")
    b = seq_lens.shape[0]
    check(
        block_tables.dim() == 2 and block_tables.shape[0] == b and block_tables.stride(1) == 1,
        "block_tables must be [B, max_blocks] with contiguous rows.",
    )
    check(tuple(query_start_loc.shape) == (b + 1,), "query_start_loc must have B + 1 entries.")
    for name, x in (("kv_cache", kv_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):  # fmt: skip
        check(x.device == q.device, f"{name} is on {x.device}, q on {q.device}.")
        check(x is kv_cache or x.dtype == torch.int32, f"{name} must be int32, got {x.dtype}.")
    check(max_query_len >= 1 and max_seq_len >= max_query_len, "bad max_query_len/max_seq_len.")
    check(window is None or window >= 1, f"window must be >= 1, got {window}.")
    if sinks is not None:
        check(
            tuple(sinks.shape) == (hq,) and sinks.stride(0) == 1 and sinks.is_floating_point(),
            f"sinks must be a contiguous float [{hq}] tensor, got {tuple(sinks.shape)}.",
        )
        check(sinks.device == q.device, f"sinks is on {sinks.device}, q on {q.device}.")

    group = hq // hkv
    block_m, block_q, tile_n, num_warps = _tiling(group, max_query_len, q.dtype, quant)
    num_stages = 2
    if tuning is not None:
        tile_n, num_warps, num_stages = tuning
        check(tile_n in (16, 32, 64, 128, 256), f"TILE_N must be a power of 2 in 16..256: {tile_n}")
    num_q_blocks = t // block_q + b
    if num_splits is None:  # keys one query block reads: at most window + its tokens
        keys = max_seq_len if window is None else min(max_seq_len, window + block_q)
        num_splits = _num_splits(q.device, num_q_blocks * hkv, keys, tile_n)
    check(num_splits in (1, 2, 4, 8, 16), f"num_splits must be a power of 2 <= 16: {num_splits}")
    d_pad = triton.next_power_of_2(d)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t == 0:
        return out
    if num_splits == 1:
        part_acc = part_m = part_l = out  # unused
    else:
        part_acc = q.new_empty(t, hq, num_splits, d_pad, dtype=torch.float32)
        part_m = q.new_empty(t, hq, num_splits, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    compute = _compute_dtype(q.dtype)
    scales = kv_scales if quant else kv_cache  # a dummy pointer when unused
    s_scales = kv_scales.stride() if quant else (0, 0, 0, 0)
    grid = (num_q_blocks, hkv, num_splits)
    _paged_attention_kernel[grid](
        out, q, kv_cache, scales, block_tables, seq_lens, query_start_loc,
        part_acc, part_m, part_l, q if sinks is None else sinks,
        scale * LOG2E, b,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv_cache.stride()[:4],
        *s_scales, block_tables.stride(0),
        NUM_Q_HEADS=hq, GROUP=group, HEAD_DIM=d, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, NUM_SPLITS=num_splits,
        QUANT=quant, COMPUTE=compute, WINDOW=window or 0, SINKS=sinks is not None,
        PRECISION="ieee" if compute == tl.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _reduce_splits_kernel[(t, hq)](
            out, part_acc, part_m, part_l, q if sinks is None else sinks,
            out.stride(0), out.stride(1),
            NUM_Q_HEADS=hq, HEAD_DIM=d, D_PAD=d_pad, NUM_SPLITS=num_splits,
            SINKS=sinks is not None,
        )  # fmt: skip
    return out

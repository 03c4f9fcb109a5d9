"""Torch reference paged attention: the ground truth the Triton kernel is tested against.

Runs one mixed prefill/decode varlen batch (see conveyor.model.attention for the layout) with
SDPA: decode rows in a few length groups (one gather + one SDPA each), every prefill chunk on
its own. Index tensors are derived once per step and window (a _TorchPlan in
meta.backend_state, see step_plan) and reused by every layer. int8 caches are gathered and
dequantised first.

Sliding window W: the token at position p sees keys p - W + 1 .. p. Decode rows and prefill
chunks gather only from the first block their window touches and mask the keys before it.

Attention sinks (gpt-oss): SDPA gets one more key, zero, with a zero value and the head's sink
as its mask entry: exp(sink - m) joins the softmax's denominator and adds nothing to the sum.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from conveyor.model.attention.metadata import AttentionBackend, AttentionMetadata
from conveyor.model.kv_cache import KVCache, QuantizedKVCache, gather_kv, write_kv_cache


@dataclass(slots=True)
class Chunk:
    """A request with more than one new token (a prefill chunk)."""

    start: int  # first token row
    end: int  # one past the last token row
    block_ids: torch.Tensor | None  # int64 [nb] when it has cached context, else None
    seq_len: int
    # additive [q, keys]: 0 where new token i (at ctx + i) sees key key_start + j, else -inf;
    # None = plain causal over the new tokens
    mask: torch.Tensor | None
    key_start: int = 0  # position of the first gathered key (a block boundary)


@dataclass(slots=True)
class _DecodeGroup:
    """Query-length-1 rows attended together: one gather, one SDPA, padded to the longest."""

    rows: slice | torch.Tensor  # their token rows (a slice when contiguous)
    block_ids: torch.Tensor  # int64 [n * nb], row-major per request
    # additive [n, 1, 1, keys]: 0 iff the column's key < seq_len (and >= seq_len - window);
    # with a window, row i's columns start at its first block in the window
    mask: torch.Tensor
    size: int


@dataclass(slots=True)
class _TorchPlan:
    """Index tensors the torch reference derives once per step and reuses in every layer."""

    decode_groups: list[_DecodeGroup]
    num_decodes: int
    chunks: list[Chunk]


# Cost of one extra decode group, in "one row x one block" units of gather + attention work
# (a group's fixed cost, measured on CPU: docs/kernels.md#measured-choices).
_GROUP_OVERHEAD = 20


def _split_by_length(rows: list[int], nbs: list[int], max_groups: int = 3) -> list[list[int]]:
    """Split decode rows into groups of similar length so padding to the longest is cheap.

    A long-context request in a batch of short ones would make every row gather and attend
    over its length. Rows are sorted by block count and cut where the padding saved beats
    the fixed cost of one more group (a few cuts at most; O(rows) per cut).

    Args:
        rows: batch indices of the decode requests; nbs: their block counts (same order).
    Returns:
        groups of batch indices, each sorted by batch index.
    """
    order = sorted(range(len(rows)), key=nbs.__getitem__)
    groups = [order]
    while len(groups) < max_groups:
        best = None  # (saving, group index, cut)
        for gi, g in enumerate(groups):
            top = nbs[g[-1]]
            for cut in range(1, len(g)):
                saving = cut * (top - nbs[g[cut - 1]]) - _GROUP_OVERHEAD
                if saving > 0 and (best is None or saving > best[0]):
                    best = (saving, gi, cut)
        if best is None:
            break
        _, gi, cut = best
        g = groups.pop(gi)
        groups[gi:gi] = [g[:cut], g[cut:]]
    return [sorted(rows[i] for i in g) for g in groups]


def _decode_group(
    meta: AttentionMetadata,
    batch_idx: list[int],
    starts: list[int],
    block_size: int,
    dtype: torch.dtype,
    window: int | None,
) -> _DecodeGroup:
    device = meta.block_tables.device
    nb = -(-max(meta.seq_lens_cpu[b] for b in batch_idx) // block_size)
    if batch_idx[-1] - batch_idx[0] + 1 == len(batch_idx):  # contiguous: views, no gathers
        first, last = batch_idx[0], batch_idx[-1] + 1
        rows: slice | torch.Tensor = slice(starts[first], starts[first] + len(batch_idx))
        tables = meta.block_tables[first:last, :nb]
        lens = meta.seq_lens[first:last]
    else:
        idx = torch.tensor(batch_idx, dtype=torch.int64, device=device)
        rows = torch.tensor([starts[b] for b in batch_idx], dtype=torch.int64, device=device)
        tables = meta.block_tables.index_select(0, idx)[:, :nb]
        lens = meta.seq_lens.index_select(0, idx)
    keys = torch.arange(nb * block_size, device=device)[None, :]  # each column's position
    if window is not None:
        firsts = [max(0, meta.seq_lens_cpu[b] - window) // block_size for b in batch_idx]
        if any(firsts):  # gather only the blocks each row's window touches
            span = max(
                -(-meta.seq_lens_cpu[b] // block_size) - f
                for b, f in zip(batch_idx, firsts, strict=True)
            )
            first = torch.tensor(firsts, dtype=torch.int64, device=device)[:, None]
            # Columns past a row's own blocks read some block of it, masked below.
            cols = (first + torch.arange(span, device=device)).clamp_(max=nb - 1)
            tables = tables.gather(1, cols)
            keys = first * block_size + torch.arange(span * block_size, device=device)
    allowed = keys < lens[:, None]
    if window is not None:
        allowed &= keys >= lens[:, None] - window
    mask = _additive(allowed, dtype).view(len(batch_idx), 1, 1, -1)
    return _DecodeGroup(rows, tables.reshape(-1).long(), mask, len(batch_idx))


_Plan = TypeVar("_Plan")


def step_plan(
    meta: AttentionMetadata, window: int | None, kind: type[_Plan], make: Callable[[], _Plan]
) -> _Plan:
    """The step's plan of type `kind` for layers with this window: made by the first such
    layer, kept in meta.backend_state (a dict by kind and window) for the others."""
    plans: Any = meta.backend_state
    if not isinstance(plans, dict):
        plans = meta.backend_state = {}
    plan = plans.get((kind, window))
    if plan is None:
        plan = plans[(kind, window)] = make()
    return plan


def _make_plan(
    meta: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int | None
) -> _TorchPlan:
    starts = [0, *itertools.accumulate(meta.query_lens_cpu)]
    # A request with one new token is a "decode row" even if it ends a prompt: same maths.
    dec = [b for b, q in enumerate(meta.query_lens_cpu) if q == 1]
    groups = []
    if dec:
        nbs = [-(-meta.seq_lens_cpu[b] // block_size) for b in dec]
        groups = [
            _decode_group(meta, g, starts, block_size, dtype, window)
            for g in _split_by_length(dec, nbs)
        ]
    return _TorchPlan(groups, len(dec), plan_chunks(meta, block_size, dtype, window))


def plan_chunks(
    meta: AttentionMetadata,
    block_size: int,
    dtype: torch.dtype,
    window: int | None = None,
    min_query_len: int = 2,
) -> list[Chunk]:
    """The step's prefill chunks (requests with at least `min_query_len` new tokens, > 1),
    with their masks (window: the layer's sliding window, None for full attention)."""
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = [0, *itertools.accumulate(q_lens)]
    device = meta.block_tables.device
    chunks = []
    for b, q in enumerate(q_lens):
        if q <= 1 or q < min_query_len:
            continue
        ctx, seq = s_lens[b] - q, s_lens[b]
        windowed = window is not None and seq > window
        if ctx == 0 and not windowed:  # fresh prompt: the new k/v directly, plain causal
            chunks.append(Chunk(starts[b], starts[b + 1], None, seq, None))
            continue
        # New token i sits at position ctx + i and sees keys 0 (or ctx + i - window + 1) ..
        # ctx + i; cached keys are gathered from the first block any of them sees.
        first = max(0, ctx - window + 1) // block_size if windowed and ctx else 0
        key_start = first * block_size
        ids = None if ctx == 0 else meta.block_tables[b, first : -(-seq // block_size)].long()
        pos = torch.arange(q, device=device)[:, None] + ctx
        keys = torch.arange(key_start, seq, device=device)[None, :]
        allowed = keys <= pos
        if windowed:
            allowed &= keys > pos - window
        chunk_mask = _additive(allowed, dtype)
        chunks.append(Chunk(starts[b], starts[b + 1], ids, seq, chunk_mask, key_start))
    return chunks


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> additive float mask, built once per step instead of inside every SDPA."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference paged attention over one mixed prefill/decode varlen batch.

    k, v must already be written into kv_cache (write_kv_cache); they are passed so that a
    fresh prompt can attend to them without a gather. GQA: Hq is a multiple of Hkv.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] (this step's new tokens).
        kv_cache: [2, num_blocks, block_size, Hkv, D].
        meta: the step's metadata; its backend_state caches the plan across layers.
        scale: softmax scale (usually head_dim ** -0.5).
        window: the layer's sliding window (None: the whole context).
        sinks: [Hq] each query head's sink logit (None: none).
    Returns:
        [T, Hq * D] attention output, rows in token order.
    """
    plan = step_plan(
        meta, window, _TorchPlan, lambda: _make_plan(meta, _block_size(kv_cache), q.dtype, window)
    )
    t, hq, d = q.shape
    groups = plan.decode_groups
    if plan.num_decodes == t and len(groups) == 1:  # pure decode, one group: its result is all
        return _decode(q, kv_cache, groups[0], scale, sinks).reshape(t, hq * d)
    out = q.new_empty(t, hq, d)
    for g in groups:
        out[g.rows] = _decode(q[g.rows], kv_cache, g, scale, sinks)
    attend_chunks(q, k, v, kv_cache, plan.chunks, out, scale, sinks)
    return out.view(t, hq * d)


def attend_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    chunks: list[Chunk],
    out: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> None:
    """Each prefill chunk's attention (one SDPA per chunk), written into out [T, Hq, D]."""
    for c in chunks:
        qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        if c.block_ids is None:
            kc = k[c.start : c.end].transpose(0, 1).unsqueeze(0)
            vc = v[c.start : c.end].transpose(0, 1).unsqueeze(0)
        else:
            kc, vc = (
                x[: c.seq_len - c.key_start].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
                for x in gather_kv(kv_cache, c.block_ids, q.dtype)
            )
        mask = c.mask
        if sinks is not None:
            if mask is None:  # causal over the chunk's own keys
                causal = torch.ones(qc.shape[2], kc.shape[2], dtype=torch.bool, device=q.device)
                mask = _additive(causal.tril_(), q.dtype)
            kc, vc, mask = _with_sinks(kc, vc, mask, sinks.view(1, -1, 1, 1))
        o = F.scaled_dot_product_attention(
            qc, kc, vc, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        out[c.start : c.end] = o[0].transpose(0, 1)


def _with_sinks(
    k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [B, Hkv, L, D] and the additive mask [..., Q, L] with one more key: zero, its
    value zero and its mask entry the sink (`sinks` broadcast to [..., Q, 1]), so its score
    is exactly the sink."""
    zero = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    rows = torch.broadcast_shapes(mask.shape[:-1], sinks.shape[:-1])
    column = sinks.to(mask.dtype).expand(*rows, 1)
    mask = torch.cat([mask.expand(*rows, mask.shape[-1]), column], dim=-1)
    return torch.cat([k, zero], dim=-2), torch.cat([v, zero], dim=-2), mask


def _decode(
    q: torch.Tensor,
    kv_cache: KVCache,
    group: _DecodeGroup,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A group of query-length-1 rows at once: one gather, one SDPA with a key-length mask.

    GQA without expanding K/V: the G query heads that share a KV head become G query rows of
    it (q [Bd, Hkv, G, D] against k, v [Bd, Hkv, L, D]); the same maths as SDPA's
    enable_gqa, faster on CPU at a decode step's shapes (docs/kernels.md#measured-choices).
    """
    bd, hq, d = q.shape
    k, v = gather_kv(kv_cache, group.block_ids, q.dtype)  # [Bd * L, Hkv, D] each
    hkv = k.shape[1]
    k = k.view(bd, -1, hkv, d).transpose(1, 2)  # [Bd, Hkv, L, D]
    v = v.view(bd, -1, hkv, d).transpose(1, 2)
    mask = group.mask
    if sinks is not None:  # query head x * G + g is row g of KV head x
        k, v, mask = _with_sinks(k, v, mask, sinks.view(1, hkv, hq // hkv, 1))
    o = F.scaled_dot_product_attention(
        q.view(bd, hkv, hq // hkv, d), k, v, attn_mask=mask, scale=scale
    )
    return o.reshape(bd, hq, d)


def _block_size(kv_cache: KVCache) -> int:
    data = kv_cache.data if isinstance(kv_cache, QuantizedKVCache) else kv_cache
    return data.shape[2]


class TorchAttentionBackend(AttentionBackend):
    """Reference backend in plain torch (CPU, or any device as a slow fallback)."""

    name = "torch"
    supports_int8_kv = True  # gathered and dequantised
    supports_sliding_window = True
    supports_sinks = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Fresh prompts attend to k/v as the cache holds them (int8: their round trip), so
        # this reference sees exactly what the Triton kernel reads back.
        k, v = write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return paged_attention(q, k, v, kv_cache, meta, scale, window, sinks)

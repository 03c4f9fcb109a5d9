"""Torch reference paged attention: the ground truth the Triton kernel is tested against.

Runs one mixed prefill/decode varlen batch (see conveyor.model.attention for the layout) with
SDPA: decode rows in a few length groups (one gather + one SDPA each), every prefill chunk on
its own. Index tensors are derived once per step (a _TorchPlan in meta.backend_state) and
reused by every layer. int8 caches are gathered and dequantised first.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from conveyor.model.kv_cache import KVCache, QuantizedKVCache, gather_kv

if TYPE_CHECKING:
    from conveyor.model.attention import AttentionMetadata


@dataclass(slots=True)
class _Chunk:
    """A request with more than one new token (a prefill chunk)."""

    start: int  # first token row
    end: int  # one past the last token row
    block_ids: torch.Tensor | None  # int64 [nb] when it has cached context, else None
    seq_len: int
    mask: torch.Tensor | None  # additive [q, seq_len]: 0 where key j <= ctx + i, else -inf;
    # None = plain causal over the new tokens


@dataclass(slots=True)
class _DecodeGroup:
    """Query-length-1 rows attended together: one gather, one SDPA, padded to the longest."""

    rows: slice | torch.Tensor  # their token rows (a slice when contiguous)
    block_ids: torch.Tensor  # int64 [n * nb], row-major per request
    mask: torch.Tensor  # additive [n, 1, 1, nb * block_size]: 0 iff key j < seq_len
    size: int


@dataclass(slots=True)
class _TorchPlan:
    """Index tensors the torch reference derives once per step and reuses in every layer."""

    decode_groups: list[_DecodeGroup]
    num_decodes: int
    chunks: list[_Chunk]


# Cost of one extra decode group, in "one row x one block" units of gather + attention work
# (measured on CPU: a group's fixed cost is about that of 20 padded row-blocks).
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
    keys = torch.arange(nb * block_size, device=device)
    mask = _additive(keys[None, :] < lens[:, None], dtype).view(len(batch_idx), 1, 1, -1)
    return _DecodeGroup(rows, tables.reshape(-1).long(), mask, len(batch_idx))


def _make_plan(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> _TorchPlan:
    starts = [0, *itertools.accumulate(meta.query_lens_cpu)]
    # A request with one new token is a "decode row" even if it ends a prompt: same maths.
    dec = [b for b, q in enumerate(meta.query_lens_cpu) if q == 1]
    groups = []
    if dec:
        nbs = [-(-meta.seq_lens_cpu[b] // block_size) for b in dec]
        groups = [
            _decode_group(meta, g, starts, block_size, dtype) for g in _split_by_length(dec, nbs)
        ]
    return _TorchPlan(groups, len(dec), plan_chunks(meta, block_size, dtype))


def plan_chunks(
    meta: AttentionMetadata, block_size: int, dtype: torch.dtype, min_query_len: int = 2
) -> list[_Chunk]:
    """The step's prefill chunks (requests with at least `min_query_len` new tokens, > 1),
    with their masks."""
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = [0, *itertools.accumulate(q_lens)]
    device = meta.block_tables.device
    chunks = []
    for b, q in enumerate(q_lens):
        if q <= 1 or q < min_query_len:
            continue
        ctx, seq = s_lens[b] - q, s_lens[b]
        if ctx == 0:  # fresh prompt: attend to the new k/v directly, plain causal
            chunks.append(_Chunk(starts[b], starts[b + 1], None, seq, None))
            continue
        nb = -(-seq // block_size)
        ids = meta.block_tables[b, :nb].long()
        # New token i sits at position ctx + i and sees keys 0 .. ctx + i.
        allowed = torch.arange(seq, device=device)[None, :] <= (
            torch.arange(q, device=device)[:, None] + ctx
        )
        chunk_mask = _additive(allowed, dtype)
        chunks.append(_Chunk(starts[b], starts[b + 1], ids, seq, chunk_mask))
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
) -> torch.Tensor:
    """Torch reference paged attention over one mixed prefill/decode varlen batch.

    k, v must already be written into kv_cache (write_kv_cache); they are passed so that a
    fresh prompt can attend to them without a gather. GQA: Hq is a multiple of Hkv.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] (this step's new tokens).
        kv_cache: [2, num_blocks, block_size, Hkv, D].
        meta: the step's metadata; its backend_state caches the plan across layers.
        scale: softmax scale (usually head_dim ** -0.5).
    Returns:
        [T, Hq * D] attention output, rows in token order.
    """
    plan = meta.backend_state
    if not isinstance(plan, _TorchPlan):
        plan = meta.backend_state = _make_plan(meta, _block_size(kv_cache), q.dtype)
    t, hq, d = q.shape
    groups = plan.decode_groups
    if plan.num_decodes == t and len(groups) == 1:  # pure decode, one group: its result is all
        return _decode(q, kv_cache, groups[0], scale).reshape(t, hq * d)
    out = q.new_empty(t, hq, d)
    for g in groups:
        out[g.rows] = _decode(q[g.rows], kv_cache, g, scale)
    attend_chunks(q, k, v, kv_cache, plan.chunks, out, scale)
    return out.view(t, hq * d)


def attend_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    chunks: list[_Chunk],
    out: torch.Tensor,
    scale: float,
) -> None:
    """Each prefill chunk's attention (one SDPA per chunk), written into out [T, Hq, D]."""
    for c in chunks:
        qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        if c.block_ids is None:
            kc = k[c.start : c.end].transpose(0, 1).unsqueeze(0)
            vc = v[c.start : c.end].transpose(0, 1).unsqueeze(0)
        else:
            kc, vc = (
                x[: c.seq_len].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
                for x in gather_kv(kv_cache, c.block_ids, q.dtype)
            )
        o = F.scaled_dot_product_attention(
            qc, kc, vc, attn_mask=c.mask, is_causal=c.mask is None, scale=scale, enable_gqa=True
        )
        out[c.start : c.end] = o[0].transpose(0, 1)


def _decode(q: torch.Tensor, kv_cache: KVCache, group: _DecodeGroup, scale: float) -> torch.Tensor:
    """A group of query-length-1 rows at once: one gather, one SDPA with a key-length mask.

    GQA without expanding K/V: the G query heads that share a KV head become G query rows of
    it (q [Bd, Hkv, G, D] against k, v [Bd, Hkv, L, D]); the same maths as SDPA's
    enable_gqa, measured about 3x faster on CPU at a decode step's shapes.
    """
    bd, hq, d = q.shape
    k, v = gather_kv(kv_cache, group.block_ids, q.dtype)  # [Bd * L, Hkv, D] each
    hkv = k.shape[1]
    k = k.view(bd, -1, hkv, d).transpose(1, 2)  # [Bd, Hkv, L, D]
    v = v.view(bd, -1, hkv, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q.view(bd, hkv, hq // hkv, d), k, v, attn_mask=group.mask, scale=scale
    )
    return o.reshape(bd, hq, d)


def _block_size(kv_cache: KVCache) -> int:
    data = kv_cache.data if isinstance(kv_cache, QuantizedKVCache) else kv_cache
    return data.shape[2]

"""Paged attention: per-step metadata, the KV cache layout and the attention backends.

One step runs ONE flat varlen batch: request b owns new tokens
query_start_loc[b] .. query_start_loc[b+1]-1, at positions seq_lens[b]-query_lens[b] ..
seq_lens[b]-1, and attends causally to its whole context (cached tokens + new ones).

KV cache, one tensor per layer: [2 (k|v), num_blocks, block_size, num_kv_heads, head_dim].
Token position p of request b lives in slot  block_tables[b][p // block_size] * block_size
+ p % block_size  of the flattened [2, num_blocks * block_size, Hkv, D] view:

    block_tables[b] = [7, 2, 9]        block_size = 4, seq_len = 10
    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .
    blocks        7         2        9      -> slot(9) = 9 * 4 + 1 = 37

Backends are a small ABC plus a registry by name; `get_attention_backend` picks one.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's varlen batch (built by the runner).

    Tensors live on the model's device; the `*_cpu` lists and max values are host copies so
    that no backend ever syncs with the device to learn a shape.
    """

    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token
    query_start_loc: torch.Tensor  # int32 [B+1]: cumulative new-token counts, batch order
    seq_lens: torch.Tensor  # int32 [B]: context length after this step (cached + new)
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # Optional: int64 [T] positions of the new tokens (runners may carry them here).
    positions: torch.Tensor | None = None
    # Per-step state a backend derives once and reuses in every layer (see prepare()).
    backend_state: Any = field(default=None, repr=False, compare=False)


def compute_positions(query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """Positions [T] (int64, CPU) of every new token: seq_len - query_len .. seq_len - 1."""
    q = torch.tensor(query_lens, dtype=torch.int64)
    ctx = torch.tensor(seq_lens, dtype=torch.int64) - q
    starts = torch.cumsum(q, 0) - q
    req = torch.repeat_interleave(torch.arange(len(query_lens)), q)
    return torch.arange(int(sum(query_lens))) - starts[req] + ctx[req]


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build AttentionMetadata from host lists (a convenience for runners and tests).

    Args:
        query_lens: new tokens per request, batch order (each >= 1).
        seq_lens: context length per request after this step (>= its query_len).
        block_tables: block ids per request, covering at least seq_len tokens.
        block_size: tokens per KV block.
        device: where the tensors go.
    """
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables need one entry per request.")
    for q, s, t in zip(query_lens, seq_lens, block_tables, strict=True):
        if q < 1 or s < q or len(t) * block_size < s:
            raise ValueError(f"bad request shape: query_len={q}, seq_len={s}, blocks={len(t)}.")
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    positions = compute_positions(query_lens, seq_lens)
    req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slots = tables[req, positions // block_size].long() * block_size + positions % block_size
    cu = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=tables.to(device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        positions=positions.to(device),
    )


class _KVShape(Protocol):
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


def kv_cache_bytes_per_block(model_config: _KVShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across ALL layers (K and V): the unit the engine budgets in."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * model_config.num_key_value_heads * model_config.head_dim
    return per_layer * model_config.num_hidden_layers * elem


def allocate_kv_caches(
    model_config: _KVShape,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, Hkv, D] tensor per layer.

    Zeroed on purpose: padded block-table entries and unwritten slots are read and then
    masked; masked scores get probability 0, and 0 * NaN garbage would still be NaN.
    """
    shape = (2, num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
    return [
        torch.zeros(shape, dtype=dtype, device=device)
        for _ in range(model_config.num_hidden_layers)
    ]


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new k, v [T, Hkv, D] into kv_cache at flat slots slot_mapping [T] (in place)."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


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
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = [0, *itertools.accumulate(q_lens)]
    device = meta.block_tables.device
    # A request with one new token is a "decode row" even if it ends a prompt: same maths.
    dec = [b for b, q in enumerate(q_lens) if q == 1]
    groups = []
    if dec:
        nbs = [-(-s_lens[b] // block_size) for b in dec]
        groups = [
            _decode_group(meta, g, starts, block_size, dtype) for g in _split_by_length(dec, nbs)
        ]
    chunks = []
    for b, q in enumerate(q_lens):
        if q <= 1:
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
    return _TorchPlan(groups, len(dec), chunks)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> additive float mask, built once per step instead of inside every SDPA."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """K/V of the given blocks: [2, len(block_ids) * block_size, Hkv, D] (one copy)."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks, block_size * hkv * d).index_select(1, block_ids)
    return flat.view(2, -1, hkv, d)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
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
        plan = meta.backend_state = _make_plan(meta, kv_cache.shape[2], q.dtype)
    t, hq, d = q.shape
    groups = plan.decode_groups
    if plan.num_decodes == t and len(groups) == 1:  # pure decode, one group: its result is all
        return _decode(q, kv_cache, groups[0], scale).reshape(t, hq * d)
    out = q.new_empty(t, hq, d)
    for g in groups:
        out[g.rows] = _decode(q[g.rows], kv_cache, g, scale)
    for c in plan.chunks:
        qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        if c.block_ids is None:
            kc = k[c.start : c.end].transpose(0, 1).unsqueeze(0)
            vc = v[c.start : c.end].transpose(0, 1).unsqueeze(0)
        else:
            kv = _gather_kv(kv_cache, c.block_ids)[:, : c.seq_len]  # [2, S, Hkv, D]
            kc, vc = kv.transpose(1, 2).unsqueeze(1).unbind(0)  # [1, Hkv, S, D] each
        o = F.scaled_dot_product_attention(
            qc, kc, vc, attn_mask=c.mask, is_causal=c.mask is None, scale=scale, enable_gqa=True
        )
        out[c.start : c.end] = o[0].transpose(0, 1)
    return out.view(t, hq * d)


def _decode(
    q: torch.Tensor, kv_cache: torch.Tensor, group: _DecodeGroup, scale: float
) -> torch.Tensor:
    """A group of query-length-1 rows at once: one gather, one SDPA with a key-length mask."""
    bd, hq, d = q.shape
    kv = _gather_kv(kv_cache, group.block_ids)  # [2, Bd * L, Hkv, D]
    kv = kv.view(2, bd, -1, kv.shape[2], d).transpose(2, 3)  # [2, Bd, Hkv, L, D]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), kv[0], kv[1], attn_mask=group.mask, scale=scale, enable_gqa=True
    )
    return o.reshape(bd, hq, d)


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache and attends (one call per layer)."""

    name: ClassVar[str]

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]; stores k/v at meta.slot_mapping."""


class TorchAttentionBackend(AttentionBackend):
    """Reference backend in plain torch (CPU, or any device as a slow fallback)."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return paged_attention(q, k, v, kv_cache, meta, scale)


_BACKENDS: dict[str, type[AttentionBackend]] = {TorchAttentionBackend.name: TorchAttentionBackend}


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Pick an attention backend by name ("auto", "torch", "triton").

    "auto" is the torch reference for now; it will pick Triton on CUDA once kernels/ exists.
    """
    device = torch.device(device)
    if name == "auto":
        name = "torch"
    if name == "triton":
        raise ValueError(
            "attention_backend 'triton' is not available yet: it comes with the Triton "
            "paged-attention kernels (kernels/). Use 'torch' or 'auto'."
        )
    if name not in _BACKENDS:
        raise ValueError(
            f"Unknown attention backend {name!r}; choose one of auto, {', '.join(_BACKENDS)}."
        )
    return _BACKENDS[name](device)

"""One step's attention for the "cpu" backend: every decode row through the C kernel
(conveyor.model.cpu_kernels, reading K/V in place from the paged cache), every prefill chunk
through SDPA as in the torch reference (conveyor.model.torch_attention).

Decode rows need no length groups or masks here: the kernel stops at each request's own
context length, so a long request in a batch of short ones costs only its own work. In a
sliding-window layer it starts at the window's first key (seq_len - window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from conveyor.model.cpu_kernels import CpuKernels
from conveyor.model.torch_attention import _Chunk, attend_chunks, plan_chunks, step_plan

if TYPE_CHECKING:
    from conveyor.model.attention import AttentionMetadata


@dataclass(slots=True)
class _CpuPlan:
    """Index tensors derived once per step (in the first layer) and reused by the others."""

    rows: torch.Tensor  # int64 [n]: token row of each request with one new token
    batch: torch.Tensor  # int64 [n]: its batch index (block table row, seq_lens entry)
    chunks: list[_Chunk]  # the requests with more than one new token


def _make_plan(
    meta: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int | None
) -> _CpuPlan:
    row, rows, batch = 0, [], []
    for b, q in enumerate(meta.query_lens_cpu):
        if q == 1:  # one new token: a decode row, even if it ends a prompt (same maths)
            rows.append(row)
            batch.append(b)
        row += q
    device = meta.block_tables.device
    return _CpuPlan(
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(batch, dtype=torch.int64, device=device),
        plan_chunks(meta, block_size, dtype, window),
    )


def cpu_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels: CpuKernels,
    window: int | None = None,
) -> torch.Tensor:
    """Paged attention over one mixed varlen batch; the same contract as
    torch_attention.paged_attention, for a float32 cache (k, v already written to it).
    window: the layer's sliding window (None: the whole context).

    Returns:
        [T, Hq * D] attention output, rows in token order.
    """
    plan = step_plan(
        meta, window, _CpuPlan, lambda: _make_plan(meta, kv_cache.shape[2], q.dtype, window)
    )
    t, hq, d = q.shape
    out = q.new_empty(t, hq, d)
    if plan.rows.numel():
        kernels.decode_attention(
            q,
            out,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            plan.rows,
            plan.batch,
            meta.max_seq_len,
            scale,
            window,
        )
    attend_chunks(q, k, v, kv_cache, plan.chunks, out, scale)
    return out.view(t, hq * d)

"""One step's attention for the "cpu" backend: every decode row and every prefill chunk of
fewer than SDPA_MIN_CHUNK tokens through the C kernel (conveyor.model.cpu.cpu_kernels), which
reads K/V in place from the paged cache; longer chunks through SDPA as in the torch reference
(conveyor.model.attention.torch_attention), whose blocked matrix products win once a chunk's causal
square is large.

In the kernel a row attends to its own context: a decode row to its request's whole
context, the token at position p of a prefill chunk to positions 0..p (causal), the chunk's
own K/V included (the kernel writes them to the cache first, in the same call); in a
sliding-window layer of window W, to positions p - W + 1 .. p. So there are no length groups,
masks or gathers: a long request in a batch of short ones costs only its own work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.model.attention.metadata import AttentionMetadata
from conveyor.model.attention.torch_attention import (
    Chunk,
    TorchAttentionBackend,
    attend_chunks,
    plan_chunks,
    step_plan,
)
from conveyor.model.cpu import cpu_kernels
from conveyor.model.cpu.cpu_kernels import AttentionRows, CpuKernels
from conveyor.model.kv_cache import KVCache, QuantizedKVCache

# Chunks of at least this many new tokens go to SDPA, whose blocked matrix products win once a
# chunk is long; below it the C kernel is faster (docs/kernels.md#measured-choices).
SDPA_MIN_CHUNK = 512


@dataclass(slots=True)
class _CpuPlan:
    """What every layer with one window reuses in a step (made by the first such layer)."""

    kernel_rows: AttentionRows  # the rows the kernel attends, their keys, checked
    chunks: list[Chunk]  # the chunks of SDPA_MIN_CHUNK or more tokens


def _make_plan(
    meta: AttentionMetadata,
    block_size: int,
    dtype: torch.dtype,
    window: int | None,
    kernels: CpuKernels,
) -> _CpuPlan:
    s_lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
    if meta.max_query_len == 1:  # decode rows: row b is request b, its keys its context
        rows = batch = np.arange(len(s_lens))
        key_end = s_lens
    else:
        q_lens = np.asarray(meta.query_lens_cpu, dtype=np.int64)
        batch = np.repeat(np.arange(len(q_lens)), q_lens)
        first_row = np.cumsum(q_lens) - q_lens
        # token i of request b's chunk sits at position s_b - q_b + i
        key_end = s_lens[batch] - q_lens[batch] + (np.arange(len(batch)) - first_row[batch]) + 1
        rows = np.flatnonzero(q_lens[batch] < SDPA_MIN_CHUNK)
        key_end = key_end[rows]
        batch = batch[rows]

    def ints(x: np.ndarray) -> torch.Tensor:  # the CPU's tensors: the backend runs nowhere else
        return torch.from_numpy(x.astype(np.int32))

    key_begin, max_keys = None, meta.max_seq_len
    if window is not None:
        key_begin = np.maximum(key_end - window, 0)
        max_keys = min(max_keys, window)
    rows_checked = kernels.attention_rows(
        meta.block_tables,
        torch.from_numpy(rows),
        torch.from_numpy(batch),
        ints(key_end),
        max_keys,
        None if key_begin is None else ints(key_begin),
    )
    chunks = plan_chunks(meta, block_size, dtype, window, min_query_len=SDPA_MIN_CHUNK)
    return _CpuPlan(rows_checked, chunks)


def cpu_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels: CpuKernels,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention over one mixed varlen batch for a float32 cache: writes this step's
    k, v [T, Hkv, D] into kv_cache at meta.slot_mapping (in the kernel's call, before any row
    attends), then the contract of torch_attention.paged_attention.
    window: the layer's sliding window (None: the whole context); sinks: [Hq] (None: none).

    Returns:
        [T, Hq * D] attention output, rows in token order.
    """
    plan = step_plan(
        meta,
        window,
        _CpuPlan,
        lambda: _make_plan(meta, kv_cache.shape[2], q.dtype, window, kernels),
    )
    t, hq, d = q.shape
    out = q.new_empty(t, hq, d)
    k, v = (x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous() for x in (k, v))
    # With no rows (every chunk long) it only writes the new K/V.
    if sinks is not None:
        sinks = sinks.float().contiguous()
    new_kv = (k, v, meta.slot_mapping)
    kernels.paged_attention(q, out, kv_cache, plan.kernel_rows, scale, new_kv, sinks)
    attend_chunks(q, k, v, kv_cache, plan.chunks, out, scale, sinks)
    return out.view(t, hq * d)


class CpuAttentionBackend(TorchAttentionBackend):
    """CPU: decode rows and prefill chunks through a C kernel that reads K/V in place from
    the paged cache (conveyor.model.cpu.cpu_kernels), long chunks through SDPA as in the torch
    reference (conveyor.model.attention.cpu_attention says where the line is).

    Float32 queries on a float32 or bfloat16 cache (the CPU bf16 path: ModelRunner); int8 or
    other dtypes, or a machine where the kernel cannot be built (no C compiler), run the torch
    reference backend it extends instead.
    """

    name = "cpu"  # int8, windows and sinks: as the reference it extends
    layer_kernels = "c"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU, not on {device}.")
        self._kernels = cpu_kernels.load()

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
        if (
            self._kernels is None
            or isinstance(kv_cache, QuantizedKVCache)
            or kv_cache.dtype not in (torch.float32, torch.bfloat16)
            or q.dtype != torch.float32
        ):
            return super().forward(q, k, v, kv_cache, meta, scale, window, sinks)
        # The kernel writes this step's K/V into the cache itself, before it attends.
        return cpu_paged_attention(q, k, v, kv_cache, meta, scale, self._kernels, window, sinks)

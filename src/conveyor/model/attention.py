"""Paged attention: per-step metadata, the KV cache layout and the attention backends.

One step runs ONE flat varlen batch: request b owns new tokens
query_start_loc[b] .. query_start_loc[b+1]-1, at positions seq_lens[b]-query_lens[b] ..
seq_lens[b]-1, and attends causally to its whole context (cached tokens + new ones), or, in
a layer with a sliding window W, to the last W keys up to its own position (keys p - W + 1 ..
p; blocks wholly before that stay allocated and are not read).

KV cache, one per layer (conveyor.model.kv_cache): [2 (k|v), num_blocks, block_size,
num_kv_heads, head_dim], in the model's dtype or int8 with per-token, per-head scales.
Token position p of request b lives in slot  block_tables[b][p // block_size] * block_size
+ p % block_size  of the flattened [2, num_blocks * block_size, Hkv, D] view:

    block_tables[b] = [7, 2, 9]        block_size = 4, seq_len = 10
    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .
    blocks        7         2        9      -> slot(9) = 9 * 4 + 1 = 37

Backends are a small ABC plus a registry by name; `get_attention_backend` picks one: the torch
reference (conveyor.model.torch_attention, the ground truth), the CPU backend (a C decode
kernel, conveyor.model.cpu_attention) or the Triton kernels (conveyor.kernels) that each
backend call runs as one KV write plus one attention launch.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from conveyor.model import cpu_kernels
from conveyor.model.cpu_attention import cpu_paged_attention
from conveyor.model.kv_cache import KVCache, QuantizedKVCache, write_kv_cache
from conveyor.model.torch_attention import paged_attention

logger = logging.getLogger(__name__)


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
    # Per-step state a backend derives in the first layer and reuses in the others (the torch
    # backend's index plans by window, torch_attention.step_plan).
    backend_state: Any = field(default=None, repr=False, compare=False)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build one step's AttentionMetadata from host lists (the runner's, every step).

    Positions and slots are computed in numpy on the host, then copied to `device` once.

    Args:
        query_lens: new tokens per request, batch order (each >= 1).
        seq_lens: context length per request after this step (>= its query_len).
        block_tables: block ids per request, covering at least seq_len tokens.
        block_size: tokens per KV block.
        device: where the tensors go.
    Returns:
        the metadata, positions included.
    Raises:
        ValueError: lists of different lengths, or a request shape that breaks the rules above.
    """
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables need one entry per request.")
    for q, s, t in zip(query_lens, seq_lens, block_tables, strict=True):
        if q < 1 or s < q or len(t) * block_size < s:
            raise ValueError(f"bad request shape: query_len={q}, seq_len={s}, blocks={len(t)}.")
    num_reqs = len(query_lens)
    q_lens = np.asarray(query_lens, dtype=np.int64)
    s_lens = np.asarray(seq_lens, dtype=np.int64)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    # position of token t = t - (start of its chunk in the flat batch) + (its first position)
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)
    starts = query_start_loc[:-1] - (s_lens - q_lens)
    positions = np.arange(query_start_loc[-1]) - starts[req_of_token]
    tables = np.zeros((num_reqs, max(len(t) for t in block_tables)), dtype=np.int64)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    slots = tables[req_of_token, positions // block_size] * block_size + positions % block_size
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(s_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(tables.astype(np.int32)).to(device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(s_lens.max()),
        positions=torch.from_numpy(positions).to(device),
    )


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
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]; stores k/v at meta.slot_mapping.

        window: the layer's sliding window (None: the whole context)."""


class TorchAttentionBackend(AttentionBackend):
    """Reference backend in plain torch (CPU, or any device as a slow fallback)."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        # Fresh prompts attend to k/v as the cache holds them (int8: their round trip), so
        # this reference sees exactly what the Triton kernel reads back.
        k, v = write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return paged_attention(q, k, v, kv_cache, meta, scale, window)


class CpuAttentionBackend(TorchAttentionBackend):
    """CPU: decode rows and prefill chunks through a C kernel that reads K/V in place from
    the paged cache (conveyor.model.cpu_kernels), long chunks through SDPA as in the torch
    reference (conveyor.model.cpu_attention says where the line is).

    Float32 queries on a float32 or bfloat16 cache (the CPU bf16 path: ModelRunner); int8 or
    other dtypes, or a machine where the kernel cannot be built (no C compiler), run the torch
    reference backend it extends instead.
    """

    name = "cpu"

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
    ) -> torch.Tensor:
        if (
            self._kernels is None
            or isinstance(kv_cache, QuantizedKVCache)
            or kv_cache.dtype not in (torch.float32, torch.bfloat16)
            or q.dtype != torch.float32
        ):
            return super().forward(q, k, v, kv_cache, meta, scale, window)
        # The kernel writes this step's K/V into the cache itself, before it attends.
        return cpu_paged_attention(q, k, v, kv_cache, meta, scale, self._kernels, window)


class TritonAttentionBackend(AttentionBackend):
    """conveyor.kernels: one KV-write launch and one paged-attention launch per layer."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._kernels = _import_kernels(device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        cache, scales = (
            (kv_cache.data, kv_cache.scales)
            if isinstance(kv_cache, QuantizedKVCache)
            else (kv_cache, None)
        )
        self._kernels.write_kv(k, v, cache, meta.slot_mapping, scales)
        out = self._kernels.paged_attention(
            q,
            cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
            kv_scales=scales,
            window=window,
        )
        return out.view(q.shape[0], -1)


def _import_kernels(device: torch.device) -> Any:
    """conveyor.kernels, or a ValueError saying why it cannot run on `device`."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend 'triton' on CPU runs Triton's interpreter, which must be "
            "switched on before start-up with TRITON_INTERPRET=1 (slow; meant for tests). "
            "Use 'torch' or 'auto' on CPU."
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"attention_backend 'triton' needs a CUDA device, got {device}.")
    try:
        import conveyor.kernels as kernels
    except ImportError as exc:
        raise ValueError(f"attention_backend 'triton' needs triton installed ({exc}).") from exc
    if (device.type == "cpu") != kernels.INTERPRETED:
        raise ValueError(
            "conveyor.kernels was imported with TRITON_INTERPRET="
            f"{int(kernels.INTERPRETED)}, which does not fit device {device}: set it (CPU) or "
            "unset it (CUDA) before anything imports conveyor.kernels."
        )
    return kernels


_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchAttentionBackend.name: TorchAttentionBackend,
    CpuAttentionBackend.name: CpuAttentionBackend,
    TritonAttentionBackend.name: TritonAttentionBackend,
}


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Pick an attention backend by name.

    "auto": Triton on CUDA (the torch reference if triton cannot be imported), "cpu" on the
    CPU (C decode kernel; it falls back to the reference by itself where it cannot run), the
    torch reference elsewhere. "triton" forces the kernels (on CPU only under
    TRITON_INTERPRET=1); "torch" forces the reference.

    Raises:
        ValueError: an unknown name, or "triton" where the kernels cannot run.
    """
    device = torch.device(device)
    if name == "auto":
        name = "cpu" if device.type == "cpu" else "torch"
        if device.type == "cuda":
            try:
                return TritonAttentionBackend(device)
            except ValueError as exc:
                logger.warning("Triton attention unavailable (%s); using torch.", exc)
    if name not in _BACKENDS:
        raise ValueError(
            f"Unknown attention backend {name!r}; choose one of auto, {', '.join(_BACKENDS)}."
        )
    return _BACKENDS[name](device)

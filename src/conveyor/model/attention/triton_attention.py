"""The Triton attention backend: conveyor.kernels' KV write and paged attention, one launch
each per layer (on CUDA; on CPU only under TRITON_INTERPRET=1, for tests)."""

from __future__ import annotations

import os
from typing import Any

import torch

from conveyor.model.attention.metadata import AttentionBackend, AttentionMetadata
from conveyor.model.kv_cache import KVCache, QuantizedKVCache


class TritonAttentionBackend(AttentionBackend):
    """conveyor.kernels: one KV-write launch and one paged-attention launch per layer."""

    name = "triton"
    supports_cuda_graphs = True  # a step's shape: from device tensors
    supports_int8_kv = True
    supports_sliding_window = True
    supports_sinks = True
    layer_kernels = "triton"

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
        sinks: torch.Tensor | None = None,
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
            sinks=sinks,
        )
        return out.view(q.shape[0], -1)


def _import_kernels(device: torch.device) -> Any:
    """conveyor.kernels.launchers, or a ValueError saying why it cannot run on `device`."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend 'triton' on CPU runs Triton's interpreter, which must be "
            "switched on before start-up with TRITON_INTERPRET=1 (slow; meant for tests). "
            "Use 'torch' or 'auto' on CPU."
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"attention_backend 'triton' needs a CUDA device, got {device}.")
    try:
        import conveyor.kernels.launchers as kernels
    except ImportError as exc:
        raise ValueError(f"attention_backend 'triton' needs triton installed ({exc}).") from exc
    if (device.type == "cpu") != kernels.INTERPRETED:
        raise ValueError(
            "conveyor.kernels.launchers was imported with TRITON_INTERPRET="
            f"{int(kernels.INTERPRETED)}, which does not fit device {device}: set it (CPU) or "
            "unset it (CUDA) before anything imports conveyor.kernels.launchers."
        )
    return kernels

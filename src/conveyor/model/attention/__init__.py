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

This package: the metadata and the backends' interface (metadata.py), a registry by name
(here: `get_attention_backend`), and one module per backend, imported only when picked:

    torch_attention.py   "torch": the reference in plain torch, the ground truth
    cpu_attention.py     "cpu": a C kernel (model/cpu/csrc/paged_attention.c) for decode rows
                         and prefill chunks, SDPA for long chunks
    triton_attention.py  "triton": conveyor.kernels, one KV write and one attention launch

A new backend is one module with an AttentionBackend subclass and one line in _BACKENDS.
"""

from __future__ import annotations

import importlib
import logging

import torch

from conveyor.model.attention.metadata import (
    AttentionBackend,
    AttentionMetadata,
    build_attention_metadata,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "backend_class",
    "build_attention_metadata",
    "get_attention_backend",
]

logger = logging.getLogger(__name__)

# name -> (module, class)
_BACKENDS = {
    "torch": ("conveyor.model.attention.torch_attention", "TorchAttentionBackend"),
    "cpu": ("conveyor.model.attention.cpu_attention", "CpuAttentionBackend"),
    "triton": ("conveyor.model.attention.triton_attention", "TritonAttentionBackend"),
}


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name` (its module imported now)."""
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


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
                return backend_class("triton")(device)
            except ValueError as exc:
                logger.warning("Triton attention unavailable (%s); using torch.", exc)
    if name not in _BACKENDS:
        raise ValueError(
            f"Unknown attention backend {name!r}; choose one of auto, {', '.join(_BACKENDS)}."
        )
    return backend_class(name)(device)

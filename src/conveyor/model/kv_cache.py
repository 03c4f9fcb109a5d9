"""The paged KV cache's tensors: layout, allocation, writes and the int8 format. How many
blocks, and what a block costs, is model/kv_sizing.py's plan; this module holds what it says.

One cache per layer: [2 (k|v), num_blocks, block_size, num_kv_heads, head_dim] in the model's
dtype, or, with kv_cache_dtype="int8", a QuantizedKVCache: the same layout in int8 plus one
fp32 scale per (token, head) for K and for V ([2, num_blocks, block_size, num_kv_heads]).

    int8, symmetric absmax per token and head:
        absmax = max(max_d |x[d]|, 1e-8)    scale = absmax * (1 / 127)
        q[d]   = clamp(floor(x[d] * (127 / absmax) + 0.5), -127, 127)      x[d] ≈ q[d] * scale
    so |x[d] - q[d] * scale| <= scale / 2 (plus fp32 rounding), and a token-head costs
    D + 4 bytes instead of 2 * D in fp16: about twice the blocks for the same memory.

The Triton write kernel (conveyor.kernels.kv_write.write_kv) produces the same bytes as the torch
functions here, which are its reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from conveyor.config.engine import KV_CACHE_DTYPES
from conveyor.model.cpu.huge_pages import ALIGN, arena_empty, huge_page_arena
from conveyor.validation import check_choice

# The absmax floor: an all-zero row stores zeros with a tiny (harmless) scale. Defined here,
# not in conveyor.kernels (which needs triton): the Triton write kernel imports it from here.
MIN_ABSMAX = 1e-8


@dataclass(slots=True)
class QuantizedKVCache:
    """One layer's int8 paged K/V and its per-token, per-head dequantisation scales."""

    data: torch.Tensor  # int8 [2, num_blocks, block_size, Hkv, D]
    scales: torch.Tensor  # fp32 [2, num_blocks, block_size, Hkv]: x ≈ data * scales[..., None]


KVCache = torch.Tensor | QuantizedKVCache


class KVShape(Protocol):
    """The layers one allocation holds: a model's config, or one group of a kv_sizing.KVPlan."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


def allocate_kv_caches(
    model_config: KVShape,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_cache_dtype: str = "auto",
) -> list[KVCache]:
    """One zeroed cache per layer of `model_config`: a [2, num_blocks, block_size, Hkv, D]
    tensor, or an int8 QuantizedKVCache.

    Zeroed on purpose: padded block-table entries and unwritten slots are read and then
    masked; masked scores get probability 0, and 0 * NaN garbage would still be NaN.
    """
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    shape = (2, num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
    layers = range(model_config.num_hidden_layers)
    kinds = [(shape, torch.int8), (shape[:4], torch.float32)] if kv_cache_dtype == "int8" else []
    kinds = kinds or [(shape, dtype)]
    if torch.device(device).type != "cpu":
        caches = [[torch.zeros(s, dtype=t, device=device) for s, t in kinds] for _ in layers]
    else:
        # On 2 MiB pages, as the weights are (model/cpu/huge_pages.py): a decode step reads
        # blocks all over the cache. One mapping for all layers, no part-used page between.
        total = len(layers) * sum(math.prod(s) * t.itemsize + ALIGN for s, t in kinds)
        with huge_page_arena(total):
            caches = [[arena_empty(s, t).zero_() for s, t in kinds] for _ in layers]
    if kv_cache_dtype == "int8":
        return [QuantizedKVCache(data, scales) for data, scales in caches]
    return [cache for (cache,) in caches]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over the last dim: x [..., D] -> (int8 [..., D], fp32 scale [...])."""
    xf = x.float()
    absmax = xf.abs().amax(-1).clamp_min(MIN_ABSMAX)
    # A true division: `127.0 / absmax` in torch is reciprocal-then-multiply, which rounds
    # differently from the kernel's division and can flip a value by one step.
    inv = torch.full_like(absmax, 127.0).div_(absmax)
    q = torch.floor(xf * inv[..., None] + 0.5).clamp_(-127, 127)
    return q.to(torch.int8), absmax * (1.0 / 127.0)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D] and scale [...] -> values in dtype."""
    return (q.float() * scale[..., None]).to(dtype)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter new k, v [T, Hkv, D] into kv_cache at flat slots slot_mapping [T] (in place).

    Returns:
        k, v as the cache now holds them, in k's dtype: the inputs themselves for a cache of
        their dtype, their round trip through a narrower one (a bfloat16 cache under float32
        activations: the CPU bf16 path) or through int8 (a QuantizedKVCache).
    """
    if isinstance(kv_cache, QuantizedKVCache):
        _, num_blocks, block_size, hkv, d = kv_cache.data.shape
        flat = kv_cache.data.view(2, num_blocks * block_size, hkv, d)
        flat_scales = kv_cache.scales.view(2, num_blocks * block_size, hkv)
        held = []
        for i, x in enumerate((k, v)):
            q, scale = quantize_int8(x)
            flat[i].index_copy_(0, slot_mapping, q)
            flat_scales[i].index_copy_(0, slot_mapping, scale)
            held.append(dequantize_int8(q, scale, x.dtype))
        return held[0], held[1]
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    dtype = k.dtype
    k, v = (x.to(kv_cache.dtype) for x in (k, v))  # no copy for a cache of their dtype
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
    return k.to(dtype), v.to(dtype)


def gather_kv(
    kv_cache: KVCache, block_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given blocks, each [len(block_ids) * block_size, Hkv, D] in dtype and
    contiguous (one copy each, and one more for a cache in another dtype; int8 caches are
    dequantised).

    Two row gathers (index_select on dim 0 of a [num_blocks, block_size * Hkv * D] view),
    which run several times faster on CPU than one gather along dim 1 of the [2, ...] cache.
    """
    if isinstance(kv_cache, QuantizedKVCache):
        _, nb, bs, hkv = kv_cache.scales.shape
        out = []
        for i in range(2):
            q = _gather_blocks(kv_cache.data[i], block_ids)
            scales = kv_cache.scales[i].view(nb, bs * hkv).index_select(0, block_ids)
            out.append(dequantize_int8(q, scales.view(-1, hkv), dtype))
        return out[0], out[1]
    k, v = _gather_blocks(kv_cache[0], block_ids), _gather_blocks(kv_cache[1], block_ids)
    return k.to(dtype), v.to(dtype)  # no copy for a cache in dtype


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] -> the blocks' rows [n * block_size, Hkv, D]."""
    num_blocks, block_size, hkv, d = cache.shape
    return cache.view(num_blocks, block_size * hkv * d).index_select(0, block_ids).view(-1, hkv, d)

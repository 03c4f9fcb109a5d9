"""Input checks shared by the kernel launchers: a bad argument is a ValueError, never a crash."""

from __future__ import annotations

import torch


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_kv_cache_dtype(
    kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, x: torch.Tensor, name: str
) -> bool:
    """An int8 cache needs fp32 scales [2, num_blocks, block_size, Hkv] on x's device; a float
    cache has x's dtype and no scales.

    Returns:
        whether the cache is int8 (quantized).
    """
    if kv_cache.dtype == torch.int8:
        check(
            kv_scales is not None
            and kv_scales.dtype == torch.float32
            and tuple(kv_scales.shape) == tuple(kv_cache.shape[:4])
            and kv_scales.device == x.device,
            "an int8 kv_cache needs fp32 kv_scales of shape [2, num_blocks, block_size, Hkv].",
        )
        return True
    check(kv_cache.dtype == x.dtype, f"kv_cache is {kv_cache.dtype}, {name} is {x.dtype}.")
    check(kv_scales is None, "kv_scales is only for an int8 kv_cache.")
    return False

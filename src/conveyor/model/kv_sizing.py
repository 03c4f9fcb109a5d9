"""Start-up, steps 3 and 4 of 4 (model/runner.py): how many KV blocks the engine gets
(size_kv_cache), their allocation and the start-up line that says what they hold
(allocate_kv_cache).

CPU: `kv_cache_space_gb` (1 GiB by default; the demo 1/8 GiB), or `num_kv_blocks`.
CUDA without either: as vLLM, the share `gpu_memory_utilization` of the device's memory, less
what is in use once the weights are loaded and one profiling forward of a full token budget
(`max_num_batched_tokens`) has reached its activation peak:

    kv bytes = total * utilization - (total - free)  - (peak allocated - allocated now)
               ^ all the engine may use   ^ in use now    ^ activations come back each step
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from conveyor.core.block_manager import cdiv
from conveyor.model.attention import build_attention_metadata
from conveyor.model.kv_cache import (
    KVCache,
    allocate_kv_caches,
    available_memory_bytes,
    kv_cache_memory_error,
)

if TYPE_CHECKING:
    from conveyor.config import EngineConfig
    from conveyor.model.runner_settings import RunnerSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    """What size_kv_cache settled on."""

    num_blocks: int
    max_model_len: int  # the context served: capped by what the cache holds for one request


def size_kv_cache(
    settings: RunnerSettings, model: torch.nn.Module, config: EngineConfig, tp: Any = None
) -> KVCacheSize:
    """Step 3: the KV cache's blocks and the context they serve, now that the weights are
    loaded: `settings`' blocks (from the budget), or on CUDA with no size given what a
    profiling forward leaves (every tensor-parallel rank the same count: what the tightest
    one holds). Checked against the memory left (the weights took some).

    Raises:
        ValueError: no room is left, or the blocks do not fit.
    """
    s = settings
    num_blocks, max_model_len = s.num_kv_blocks, s.max_model_len
    if num_blocks is None:
        kv_bytes = profile_cuda_kv_bytes(
            model, s.device, s.dtype, config.max_num_batched_tokens, s.block_size,
            config.gpu_memory_utilization, s.kv_cache_dtype,
        )  # fmt: skip
        if kv_bytes < s.bytes_per_block:
            raise ValueError(
                "no GPU memory is left for the KV cache after the weights and a forward "
                f"of max_num_batched_tokens={config.max_num_batched_tokens} tokens at "
                f"gpu_memory_utilization={config.gpu_memory_utilization:g}: raise "
                "--gpu-memory-utilization, lower --max-num-batched-tokens, or set "
                "--num-kv-blocks."
            )
        num_blocks = min(kv_bytes // s.bytes_per_block, s.max_kv_blocks)
        if tp is not None:  # every rank the same count: what the tightest one holds
            num_blocks = tp.agree_min(num_blocks)
        max_model_len = fit_context_to_cache(
            max_model_len, num_blocks, s.block_size, config.max_model_len, s.device
        )
    check_kv_cache_fits(
        num_blocks, s.bytes_per_block, s.device, config.num_kv_blocks, s.kv_cache_space_gb
    )  # again: the weights took some
    return KVCacheSize(num_blocks, max_model_len)


def allocate_kv_cache(
    size: KVCacheSize, settings: RunnerSettings, kv_config: Any, config: EngineConfig
) -> list[KVCache]:
    """Step 4: one zeroed cache per layer of `kv_config` (the model's: this rank's KV heads),
    and the start-up line.

    Raises:
        ValueError: the memory could not be had (kv_cache.kv_cache_memory_error).
    """
    s = settings
    try:
        caches = allocate_kv_caches(
            kv_config, size.num_blocks, s.block_size, s.kv_dtype, s.device, s.kv_cache_dtype
        )
    except (RuntimeError, MemoryError) as exc:  # CPU "can't allocate memory", CUDA OOM
        raise kv_cache_memory_error(
            size.num_blocks, s.bytes_per_block, s.device, config.num_kv_blocks,
            s.kv_cache_space_gb,
        ) from exc  # fmt: skip
    log_kv_cache(
        size.num_blocks,
        s.block_size,
        "int8" if s.kv_cache_dtype == "int8" else str(s.kv_dtype).removeprefix("torch."),
        size.num_blocks * s.bytes_per_block / 2**20,
        size.max_model_len,
    )
    return caches


def fit_context_to_cache(
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    requested: int | None,
    device: torch.device,
) -> int:
    """As vLLM: the effective max_model_len is the model's context capped by what the KV
    cache holds for one request, so that a long-context model with a small cache still
    serves what fits (and max_tokens defaults to what that leaves). An explicit
    max_model_len (`requested`) beyond the cache is a start-up error."""
    capacity = num_blocks * block_size
    if max_model_len <= capacity:
        return max_model_len
    if requested is not None:
        room = "--kv-cache-space-gb or --num-kv-blocks"
        if device.type == "cuda":
            room += " (or --gpu-memory-utilization)"
        raise ValueError(
            f"max_model_len {max_model_len} is more than the KV cache holds for one "
            f"request ({num_blocks} blocks of {block_size} = {capacity} "
            f"tokens): lower --max-model-len, or give the cache more room with {room}."
        )
    logger.info(
        "max_model_len %d: what the KV cache holds for one request (the model's context "
        "is %d; --max-model-len or a larger cache changes it).",
        capacity,
        max_model_len,
    )
    return capacity


def check_kv_cache_fits(
    num_blocks: int,
    bytes_per_block: int,
    device: torch.device,
    num_kv_blocks: int | None,
    kv_cache_space_gb: float,
) -> None:
    """ValueError (kv_cache_memory_error) when `device` has not the memory for the blocks."""
    available = available_memory_bytes(device)
    if available is not None and num_blocks * bytes_per_block > available:
        raise kv_cache_memory_error(
            num_blocks, bytes_per_block, device, num_kv_blocks, kv_cache_space_gb
        )


def kv_bytes_from_profile(total: int, free: int, activation_peak: int, utilization: float) -> int:
    """KV cache bytes left by a profiled run (see the module docstring); 0 if none.

    Args:
        total, free: the device's memory now (torch.cuda.mem_get_info), after the weights
            and the profiling forward.
        activation_peak: bytes the forward allocated at its peak beyond what is still held.
        utilization: the share of `total` the engine may use, in (0, 1].
    """
    return max(0, int(total * utilization) - (total - free) - activation_peak)


@torch.inference_mode()
def profile_cuda_kv_bytes(
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    num_tokens: int,
    block_size: int,
    utilization: float,
    kv_cache_dtype: str,
) -> int:
    """Run one forward of `num_tokens` prompt tokens (one request, a throwaway cache) and size
    the KV cache from what the device has left (`kv_bytes_from_profile`)."""
    cfg = model.kv_config  # a tensor-parallel rank: its own KV heads
    num_blocks = cdiv(num_tokens, block_size)
    caches = allocate_kv_caches(cfg, num_blocks, block_size, dtype, device, kv_cache_dtype)
    meta = build_attention_metadata(
        [num_tokens], [num_tokens], [list(range(num_blocks))], block_size, device
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    hidden = model(ids, meta.positions, caches, meta)
    model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del caches, hidden, meta, ids
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    return kv_bytes_from_profile(total, free, peak - held, utilization)


def log_kv_cache(
    num_blocks: int, block_size: int, kind: str, mib: float, max_model_len: int
) -> None:
    """The start-up line: blocks, tokens of KV, memory, and how many requests of the full
    context fit at once."""
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens), %s (%.1f MiB); maximum concurrency "
        "for %d tokens per request: %.2fx",
        num_blocks,
        block_size,
        num_blocks * block_size,
        kind,
        mib,
        max_model_len,
        num_blocks / cdiv(max_model_len, block_size),
    )

"""The KV cache's plan, its one owner: what a block costs in each layer group, the memory
budget, how many blocks fit and the context they serve (model/kv_cache.py allocates what a
plan says). Start-up (model/runner.py) asks it twice, around the weights' load:

    plan_kv_cache      before: each group's bytes per block; the blocks the budget buys
                       (num_kv_blocks, or kv_cache_space_gb: 1 GiB by default, the demo 1/8 GiB)
                       up to what max_num_seqs sequences of max_model_len tokens can use;
                       max_model_len fit to them; refused now if memory cannot hold them
    allocate_kv_cache  after: CUDA with neither size given, measured (below); checked again
                       (the weights took some); the tensors and the start-up line

Measured, as vLLM: the share `gpu_memory_utilization` of the device's memory, less what is in
use once the weights are loaded and one profiling forward of a full token budget
(`max_num_batched_tokens`) has reached its activation peak:

    kv bytes = total * utilization - (total - free)  - (peak allocated - allocated now)
               ^ all the engine may use   ^ in use now    ^ activations come back each step
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from conveyor.config.engine import KV_CACHE_DTYPES
from conveyor.core.block_manager import cdiv
from conveyor.model.attention.metadata import build_attention_metadata
from conveyor.model.kv_cache import KVCache, KVShape, allocate_kv_caches
from conveyor.validation import check_choice

if TYPE_CHECKING:
    from conveyor.config import EngineConfig
    from conveyor.model.runner_settings import RunnerSettings

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_SPACE_GB = 1.0
# The demo model is tiny: 128 MiB holds 2048 blocks (32k tokens), plenty for trying it out.
DEMO_KV_CACHE_SPACE_GB = 0.125


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers whose caches have one shape; today a single group holds every layer."""

    num_hidden_layers: int
    num_key_value_heads: int  # this rank's, tensor-parallel
    head_dim: int
    bytes_per_block: int  # one block in each of its layers, K and V


@dataclass(frozen=True, slots=True)
class KVPlan:
    """What the KV cache is: its groups, its blocks and the context they serve."""

    groups: tuple[KVGroup, ...]
    block_size: int
    dtype: torch.dtype  # the cache's, unless kv_cache_dtype is "int8"
    kv_cache_dtype: str  # "auto" or "int8"
    device: torch.device
    space_gb: float  # the budget: kv_cache_space_gb, or its default
    max_blocks: int  # what max_num_seqs sequences of max_model_len tokens can use
    num_blocks: int | None  # None: measured once the weights are loaded (CUDA)
    max_model_len: int  # the model's context, capped by max_model_len and the cache

    @property
    def bytes_per_block(self) -> int:
        """One block across every group: the unit the budget is spent in."""
        return sum(g.bytes_per_block for g in self.groups)


def kv_cache_bytes_per_block(
    model_config: KVShape, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one block costs across all of `model_config`'s layers (K and V).

    Args:
        dtype: the cache's with kv_cache_dtype "auto".
        kv_cache_dtype: "auto" or "int8" (1 byte per element + a 4-byte scale per token-head).
    """
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    hkv, d = model_config.num_key_value_heads, model_config.head_dim
    per_token_head = d + 4 if kv_cache_dtype == "int8" else d * dtype.itemsize
    return 2 * block_size * hkv * per_token_head * model_config.num_hidden_layers


def plan_kv_cache(settings: RunnerSettings, config: EngineConfig) -> KVPlan:
    """Before the weights load: the plan `settings` and `config` make, its blocks left None
    on CUDA with neither num_kv_blocks nor kv_cache_space_gb (measured after the load).

    Raises:
        ValueError: memory cannot hold the blocks, or an explicit max_model_len is more than
            they hold for one request.
    """
    s, cfg = settings, settings.kv_config  # cfg: this rank's KV heads
    group = KVGroup(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
        kv_cache_bytes_per_block(cfg, s.block_size, s.kv_dtype, s.kv_cache_dtype),
    )  # fmt: skip
    space_gb = config.kv_cache_space_gb or (
        DEMO_KV_CACHE_SPACE_GB if config.model is None else DEFAULT_KV_CACHE_SPACE_GB
    )
    # Blocks beyond what max_num_seqs sequences of max_model_len tokens hold at once could
    # never be used: they are not allocated.
    most = config.max_num_seqs * cdiv(s.max_model_len, s.block_size)
    plan = KVPlan(
        (group,), s.block_size, s.kv_dtype, s.kv_cache_dtype, s.device, space_gb, most,
        None, s.max_model_len,
    )  # fmt: skip
    if config.num_kv_blocks is not None:
        return _fit(plan, config.num_kv_blocks, config)
    if s.device.type == "cuda" and config.kv_cache_space_gb is None:
        return plan  # from what the weights and a profiling forward leave
    budget = int(space_gb * (1 << 30))
    return _fit(plan, max(1, min(budget // plan.bytes_per_block, most)), config)


def allocate_kv_cache(
    plan: KVPlan, model: torch.nn.Module, config: EngineConfig, tp: Any = None
) -> tuple[KVPlan, list[KVCache]]:
    """After the weights load: the plan settled (on CUDA with no size given, what a profiling
    forward leaves, every tensor-parallel rank the same count: what the tightest one holds),
    checked against the memory left, and one zeroed cache per layer; the start-up line.

    Raises:
        ValueError: no room is left, or the blocks do not fit or could not be had.
    """
    num_blocks = plan.num_blocks
    if num_blocks is None:
        kv_bytes = profile_cuda_kv_bytes(
            model, plan.device, plan.dtype, config.max_num_batched_tokens,
            plan.block_size, config.gpu_memory_utilization, plan.kv_cache_dtype,
        )  # fmt: skip
        if kv_bytes < plan.bytes_per_block:
            raise ValueError(
                "no GPU memory is left for the KV cache after the weights and a forward "
                f"of max_num_batched_tokens={config.max_num_batched_tokens} tokens at "
                f"gpu_memory_utilization={config.gpu_memory_utilization:g}: raise "
                "--gpu-memory-utilization, lower --max-num-batched-tokens, or set "
                "--num-kv-blocks."
            )
        num_blocks = min(kv_bytes // plan.bytes_per_block, plan.max_blocks)
        if tp is not None:
            num_blocks = tp.agree_min(num_blocks)
    plan = _fit(plan, num_blocks, config)  # again: the weights took some
    try:
        caches = [
            cache
            for g in plan.groups
            for cache in allocate_kv_caches(
                g, num_blocks, plan.block_size, plan.dtype, plan.device, plan.kv_cache_dtype
            )
        ]
    except (RuntimeError, MemoryError) as exc:  # CPU "can't allocate memory", CUDA OOM
        raise _memory_error(plan, num_blocks, config.num_kv_blocks) from exc
    # The start-up line: blocks, tokens, memory, and how many full-context requests fit.
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens), %s (%.1f MiB); maximum concurrency "
        "for %d tokens per request: %.2fx",
        num_blocks,
        plan.block_size,
        num_blocks * plan.block_size,
        "int8" if plan.kv_cache_dtype == "int8" else str(plan.dtype).removeprefix("torch."),
        num_blocks * plan.bytes_per_block / 2**20,
        plan.max_model_len,
        num_blocks / cdiv(plan.max_model_len, plan.block_size),
    )
    return plan, caches


def _fit(plan: KVPlan, num_blocks: int, config: EngineConfig) -> KVPlan:
    """`plan` with `num_blocks` and the context they serve, once memory can hold them."""
    max_model_len = fit_context_to_cache(
        plan.max_model_len, num_blocks, plan.block_size, config.max_model_len, plan.device
    )
    available = available_memory_bytes(plan.device)
    if available is not None and num_blocks * plan.bytes_per_block > available:
        raise _memory_error(plan, num_blocks, config.num_kv_blocks)
    return dataclasses.replace(plan, num_blocks=num_blocks, max_model_len=max_model_len)


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


def available_memory_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device` now: CUDA's free memory, or on CPU the kernel's
    MemAvailable (what can be had without swapping); None when it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _memory_error(plan: KVPlan, num_blocks: int, num_kv_blocks: int | None) -> ValueError:
    """The error for blocks that do not fit: asked, available, the flag that lowers it."""
    available = available_memory_bytes(plan.device) or 0
    gib = 1 << 30
    fit = available // plan.bytes_per_block
    if num_kv_blocks is not None:
        lower = f"lower --num-kv-blocks (now {num_kv_blocks}; about {fit} fit)"
    else:
        lower = (
            f"lower --kv-cache-space-gb (now {plan.space_gb:g}) or set --num-kv-blocks "
            f"(about {fit} fit)"
        )
    return ValueError(
        f"the KV cache needs {num_blocks * plan.bytes_per_block / gib:.1f} GiB ({num_blocks} "
        f"blocks) but only {available / gib:.1f} GiB of {plan.device.type.upper()} memory is "
        f"available; {lower}."
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

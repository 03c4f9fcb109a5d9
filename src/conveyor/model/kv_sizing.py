"""How many KV blocks the engine gets, and the start-up line that says what they hold.

CPU: `kv_cache_space_gb` (1 GiB by default; the demo 1/8 GiB), or `num_kv_blocks`.
CUDA without either: as vLLM, the share `gpu_memory_utilization` of the device's memory, less
what is in use once the weights are loaded and one profiling forward of a full token budget
(`max_num_batched_tokens`) has reached its activation peak:

    kv bytes = total * utilization - (total - free)  - (peak allocated - allocated now)
               ^ all the engine may use   ^ in use now    ^ activations come back each step
"""

from __future__ import annotations

import logging

import torch

from conveyor.core.block_manager import cdiv
from conveyor.model.attention import build_attention_metadata
from conveyor.model.kv_cache import allocate_kv_caches

logger = logging.getLogger(__name__)


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

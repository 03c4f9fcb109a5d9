"""Start-up, step 1 of 4 (model/runner.py): every choice the runner makes from the engine's
config and the checkpoint's config.json, resolved and checked before anything loads.

    device       "auto": cuda when there is one; a tensor-parallel rank: its local GPU
    dtypes       the activations', the weights' and the KV cache's (resolve_dtype; on CPU
                 with our GEMM, bfloat16 weights and cache under float32 activations)
    linear GEMM  linear.resolve_linear_backend ("auto": the C kernel where it is vectorized)
    model        its class (an unsupported architecture is named first) and its config, this
                 rank's KV heads
    KV budget    max_model_len (at most the model's context), bytes per block and the blocks
                 the budget buys (kv_cache_space_gb or num_kv_blocks), refused now if memory
                 cannot hold them; CUDA with neither: measured after the load (kv_sizing.py)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.config import EngineConfig
from conveyor.core.block_manager import cdiv
from conveyor.model.cpu.linear import resolve_linear_backend
from conveyor.model.kv_cache import kv_cache_bytes_per_block
from conveyor.model.kv_sizing import check_kv_cache_fits, fit_context_to_cache
from conveyor.model.loading.loader import model_config, resolve_dtype, resolve_model_class
from conveyor.model.loading.model_config import ModelConfig
from conveyor.parallel.group import TPGroup
from conveyor.parallel.sharding import Shard

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_SPACE_GB = 1.0
# The demo model is tiny: 128 MiB holds 2048 blocks (32k tokens), plenty for trying it out.
DEMO_KV_CACHE_SPACE_GB = 0.125


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA GPU is available.")
    return torch.device(name)


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    """The runner's resolved choices (see the module docstring)."""

    device: torch.device
    dtype: torch.dtype  # the activations' (and of everything but the weights and the cache)
    weight_dtype: torch.dtype  # the linears' and the embedding's
    kv_dtype: torch.dtype  # the KV cache's, unless kv_cache_dtype is "int8"
    kv_cache_dtype: str  # "auto" or "int8"
    linear_backend: str  # "torch", "onednn" or "cpu"
    attention_backend: str
    block_size: int
    kv_config: ModelConfig  # what this rank's KV cache holds (its KV heads)
    max_model_len: int  # the model's context, capped by max_model_len and the cache
    bytes_per_block: int
    kv_cache_space_gb: float
    num_kv_blocks: int | None  # None: measured once the weights are loaded (CUDA)
    max_kv_blocks: int  # what max_num_seqs sequences of max_model_len tokens can use


def resolve_settings(
    config: EngineConfig, hf_config: dict[str, Any], tp: TPGroup | None = None
) -> RunnerSettings:
    """Step 1: the settings `config` means for this checkpoint (config.json: `hf_config`) on
    this rank (`tp`; None: the whole model here).

    Raises:
        ValueError: a device, dtype or GEMM that cannot run here, an unsupported checkpoint,
            or a KV cache that cannot fit (before the weights load).
    """
    device = resolve_device(config.device)
    if tp is not None and device.type == "cuda":
        device = torch.device("cuda", tp.local_rank)
    # "auto": see resolve_dtype (CPU: bfloat16 where it has native bf16 dot products).
    dtype = resolve_dtype(config.dtype, device, hf_config)
    if config.dtype == "auto":
        logger.info("dtype auto: %s.", str(dtype).removeprefix("torch."))
    # Before the weights load, so an impossible choice is reported at once.
    linear_backend = resolve_linear_backend(config.linear_backend, device, dtype)
    # dtype is the activations'; the weights and the KV cache may be held narrower. On CPU
    # our GEMM takes bfloat16 weights under float32 activations, and the attention kernel a
    # bfloat16 cache: what a decode step streams in half the bytes, every product and sum in
    # float32.
    weight_dtype = kv_dtype = dtype  # kv_dtype: unless kv_cache_dtype int8
    if linear_backend == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float32
        logger.info(
            "dtype bfloat16 on CPU: bfloat16 weights (our GEMM) and KV cache, float32 activations."
        )
    cls = resolve_model_class(hf_config)  # an unsupported architecture is named first
    kv_config = model_config(hf_config)
    context = kv_config.max_position_embeddings
    max_model_len = min(config.max_model_len or context, context)
    if config.max_model_len is not None and config.max_model_len > context:
        logger.warning(
            "max_model_len %d is more than the model's context (max_position_embeddings "
            "in config.json); capped to %d.",
            config.max_model_len,
            context,
        )
    if tp is not None:  # a rank's cache holds its KV heads only
        shard = Shard.of(kv_config, tp.rank, tp.size, cls.SPEC.tp_splits)
        kv_config = shard.local_config(kv_config)
    bytes_per_block = kv_cache_bytes_per_block(
        kv_config, config.block_size, kv_dtype, config.kv_cache_dtype
    )
    kv_cache_space_gb = config.kv_cache_space_gb or (
        DEMO_KV_CACHE_SPACE_GB if config.model is None else DEFAULT_KV_CACHE_SPACE_GB
    )
    # Blocks beyond what max_num_seqs sequences of max_model_len tokens hold at once could
    # never be used: do not allocate them.
    most = config.max_num_seqs * cdiv(max_model_len, config.block_size)
    # CUDA with no size given: from what the weights and a profiling forward leave.
    measured = (
        device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_space_gb is None
    )
    num_kv_blocks = None
    if not measured:
        if config.num_kv_blocks is not None:
            num_kv_blocks = config.num_kv_blocks
        else:
            budget = int(kv_cache_space_gb * (1 << 30))
            num_kv_blocks = max(1, min(budget // bytes_per_block, most))
        # The KV cache is sized from config.json alone, so one that cannot fit in memory is
        # refused before the weights load.
        max_model_len = fit_context_to_cache(
            max_model_len, num_kv_blocks, config.block_size, config.max_model_len, device
        )
        check_kv_cache_fits(
            num_kv_blocks, bytes_per_block, device, config.num_kv_blocks, kv_cache_space_gb
        )
    return RunnerSettings(
        device=device,
        dtype=dtype,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        linear_backend=linear_backend,
        attention_backend=config.attention_backend,
        block_size=config.block_size,
        kv_config=kv_config,
        max_model_len=max_model_len,
        bytes_per_block=bytes_per_block,
        kv_cache_space_gb=kv_cache_space_gb,
        num_kv_blocks=num_kv_blocks,
        max_kv_blocks=most,
    )

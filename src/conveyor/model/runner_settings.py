"""Start-up, step 1 (model/runner.py): every choice the runner makes from the engine's config
and the checkpoint's config.json, resolved and checked before anything loads.

    device       "auto": cuda when there is one; a tensor-parallel rank: its local GPU
    dtypes       the activations', the weights' and the KV cache's (hf_config.resolve_dtype;
                 on CPU with our GEMM, bfloat16 weights and cache under float32 activations)
    linear GEMM  linear.resolve_linear_backend ("auto": the C kernel where it is vectorized)
    model        its class (an unsupported architecture is named first) and its config, this
                 rank's KV heads, and max_model_len (at most the model's context)
    attention    the backend (attention/registry.py), refused if it cannot run the model's
                 sliding windows, its attention sinks or an int8 cache

How many KV blocks these buy is the KV planner's (model/kv_sizing.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.config import EngineConfig
from conveyor.model.attention.metadata import AttentionBackend
from conveyor.model.attention.registry import get_attention_backend
from conveyor.model.cpu.linear import resolve_linear_backend
from conveyor.model.distributed.group import TPGroup
from conveyor.model.distributed.sharding import Shard
from conveyor.model.loading.hf_config import model_config, resolve_dtype, resolve_model_class
from conveyor.model.loading.model_config import ModelConfig

logger = logging.getLogger(__name__)


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
    attention_backend: AttentionBackend  # the one every layer shares
    block_size: int
    kv_config: ModelConfig  # what this rank's KV cache holds (its KV heads)
    max_model_len: int  # the model's context, capped by max_model_len


def resolve_settings(
    config: EngineConfig, hf_config: dict[str, Any], tp: TPGroup | None = None
) -> RunnerSettings:
    """Step 1: the settings `config` means for this checkpoint (config.json: `hf_config`) on
    this rank (`tp`; None: the whole model here).

    Raises:
        ValueError: a device, dtype, GEMM or attention backend that cannot run here, or an
            unsupported checkpoint.
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
    attention = get_attention_backend(config.attention_backend, device)
    windows = any(w is not None for w in kv_config.layer_windows)
    attention.check_supports(config.kv_cache_dtype, windows, cls.attention_sinks)
    return RunnerSettings(
        device=device,
        dtype=dtype,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        linear_backend=linear_backend,
        attention_backend=attention,
        block_size=config.block_size,
        kv_config=kv_config,
        max_model_len=min(config.max_model_len or context, context),
    )

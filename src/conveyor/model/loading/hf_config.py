"""A checkpoint's config and what it decides: the dict (config.json, or what a GGUF file's
metadata makes), the class that serves its architecture (`MODEL_REGISTRY`), its ModelConfig,
and the dtype "auto" means for it on a device.

The runner's settings (model/runner_settings.py) and the loader (loader.py) both read the
checkpoint through these; neither asks the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from conveyor.config.engine import DTYPES
from conveyor.model.cpu import cpu_build
from conveyor.model.loading.checkpoint import find_gguf_file, read_config_json
from conveyor.model.loading.gguf_loader import read_gguf_config
from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.models import FAMILIES
from conveyor.model.models.llama import LlamaForCausalLM

# config.json architecture -> class: each family's own name first, then the other names it
# serves (the bare decoders, no head: embedding checkpoints saved from AutoModel).
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    name: cls for cls in FAMILIES for name in cls.SPEC.architectures[:1]
} | {name: cls for cls in FAMILIES for name in cls.SPEC.architectures[1:]}

# The one name -> dtype table: EngineConfig's dtype names, "auto" aside (resolve_dtype).
_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in DTYPES if n != "auto"}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory, or the config dict of a GGUF file
    (ValueError naming the file if it is missing, not valid JSON or an unsupported GGUF)."""
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return read_gguf_config(gguf_file)
    return read_config_json(path)


def resolve_model_class(hf_config: dict[str, Any]) -> type[LlamaForCausalLM]:
    """The registered class for the checkpoint's first architecture (ValueError if none)."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"Unsupported architecture {archs or None}; supported: {', '.join(MODEL_REGISTRY)}."
    )


def model_config(hf_config: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a checkpoint's config dict, read with its family's config names and
    defaults, and checked by the family (ValueError for an unsupported architecture or
    config)."""
    cls = resolve_model_class(hf_config)
    spec = cls.SPEC
    config = ModelConfig.from_hf_config({**spec.config_defaults, **hf_config}, spec.config_names)
    if spec.check_config is not None:
        spec.check_config(config)
    return config


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 pairs natively (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_build.cpu_flags())


def resolve_dtype(
    dtype: torch.dtype | str, device: torch.device, hf_config: dict[str, Any] | None = None
) -> torch.dtype:
    """A torch dtype from a dtype or one of `DTYPES`' names.

    "auto" on CPU: bfloat16 for a bfloat16 checkpoint (`hf_config`'s dtype) where the CPU
    has native bf16 dot products (AVX512-BF16 or AMX-BF16, cpu_has_native_bf16), as vLLM-CPU
    does; float32 otherwise: for other checkpoints (quantized GGUF files included) and on
    CPUs without them, and "float32" keeps exact parity anywhere ("bfloat16" selects the CPU
    bf16 path on any CPU: linear.py). On CUDA it follows the checkpoint when that is float16
    or bfloat16, and is bfloat16 for a float32 checkpoint, one that names no dtype, or no
    `hf_config`. Other devices: float32.

    Args:
        dtype: a torch dtype (returned as is), "auto", "float32", "float16" or "bfloat16".
        device: the device the model runs on.
        hf_config: the checkpoint's config.json, to make "auto" follow the checkpoint.
    Returns:
        the dtype.
    Raises:
        ValueError: an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        name = (hf_config or {}).get("dtype") or (hf_config or {}).get("torch_dtype")
        if device.type == "cpu":
            native = name == "bfloat16" and cpu_has_native_bf16()
            return torch.bfloat16 if native else torch.float32
        if device.type != "cuda":
            return torch.float32
        return _DTYPES[name] if name in ("float16", "bfloat16") else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}.")
    return _DTYPES[dtype]

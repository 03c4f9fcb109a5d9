"""Load an HF checkpoint directory (config.json + *.safetensors) into our modules.

The class comes from `config.json["architectures"]` through `MODEL_REGISTRY` (hf_config.py),
read from the families' declarations (model/models/__init__.py's FAMILIES, each class's
`SPEC`: its architecture names, config names, fused weights and tensor-parallel splits). The
model is built on the meta device (no random init), then every parameter is assigned from the
checkpoint, converted to the target dtype/device (Llama's names):

    HF name                                   ours
    model.layers.N.self_attn.{q,k,v}_proj.*   model.layers.N.self_attn.qkv_proj.*  (cat dim 0)
    model.layers.N.mlp.{gate,up}_proj.*       model.layers.N.mlp.gate_up_proj.*    (cat dim 0)
    lm_head.weight                            lm_head.weight, or absent when tied
    layers.N... / embed_tokens.* / norm.*     model.layers.N... (a bare decoder saved without
                                              its head, e.g. `LlamaModel` / `Qwen3Model`, as
                                              embedding checkpoints such as Qwen3-Embedding are)
    everything else                           same name

A GGUF file (model/loading/gguf_loader.py) goes through the same path: its metadata becomes the
config dict and its tensors, renamed to HF names, the tensor stream. They are dequantized, or
with `keep_quantized` a weight of a type in quant_linear.QUANT_TYPES (Q8_0, Q4_0, Q4_1, MXFP4,
Q4_K, Q5_K, Q6_K) arrives as a QuantTensor and its module is replaced by a QuantLinear /
QuantEmbedding holding the file's blocks (model/cpu/quant_linear.py);
a tied head then shares the embedding's blocks. An HF MXFP4 checkpoint's expert stacks
(gpt-oss) arrive the same way, repacked into GGUF's MXFP4 blocks, or dequantized where the C
kernels do not run the linears (model/loading/mxfp4.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from conveyor.model.attention.metadata import AttentionBackend
from conveyor.model.attention.registry import get_attention_backend
from conveyor.model.cpu import cpu_kernels
from conveyor.model.cpu.fused_layers import FusedLayers
from conveyor.model.cpu.huge_pages import huge_page_arena
from conveyor.model.cpu.linear import linear_factory, pack_linears
from conveyor.model.cpu.quant_linear import (
    QUANT_TYPES,
    QuantEmbedding,
    set_activation_passes,
)
from conveyor.model.distributed.sharding import Shard
from conveyor.model.loading.assign_weights import assign_weights
from conveyor.model.loading.checkpoint import find_gguf_file
from conveyor.model.loading.gguf_loader import iter_gguf_tensors, open_gguf, release_gguf
from conveyor.model.loading.hf_config import (
    model_config,
    read_hf_config,
    resolve_dtype,
    resolve_model_class,
)
from conveyor.model.loading.mxfp4 import is_mxfp4, mxfp4_tensors
from conveyor.model.loading.safetensors_mmap import MappedTensor, iter_mapped_tensors
from conveyor.model.models.layers import use_kernels
from conveyor.model.models.llama import LlamaForCausalLM
from conveyor.model.models.moe import use_cpu_kernels, use_grouped_gemm

if TYPE_CHECKING:
    from conveyor.config import EngineConfig
    from conveyor.model.cpu.cpu_kernels import CpuKernels

logger = logging.getLogger(__name__)


class LoadSettings(Protocol):
    """What load_weights reads of the runner's settings (model/runner_settings.py's
    RunnerSettings is one), named here so that the loader imports nothing of the runner's."""

    device: torch.device
    dtype: torch.dtype  # the activations'
    weight_dtype: torch.dtype  # the linears' and the embedding's
    linear_backend: str
    attention_backend: AttentionBackend


def checkpoint_files(path: str | Path) -> list[Path]:
    """model.safetensors, or the shards listed in model.safetensors.index.json."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"No model.safetensors or model.safetensors.index.json in {path}.")


def iter_checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, MappedTensor]]:
    """(name, tensor as a view of the file's memory map) for every tensor in the given
    safetensors files, with a progress bar over the shards when there are several."""
    bar = tqdm(files, desc="Loading safetensors shards", unit="shard", disable=len(files) < 2)
    for file in bar:
        yield from iter_mapped_tensors(file)


def _checkpoint_names(files: list[Path]) -> set[str]:
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    attention_backend: str = "auto",
    tp: Any = None,
    keep_quantized: bool = False,
    linear_dtype: torch.dtype | None = None,
) -> LlamaForCausalLM:
    """Load a checkpoint directory into our model, in eval mode on device/dtype: the names
    resolved here, the rest as build_model.

    Args:
        path: HF checkpoint directory (config.json + safetensors), a GGUF file, or a folder
            holding one GGUF file.
        dtype: torch dtype or "auto" / "float32" / "float16" / "bfloat16" ("auto": float32
            on CPU; on CUDA the checkpoint's half-precision dtype, else bfloat16; see
            resolve_dtype).
        device: torch device or name ("auto": cuda when available, else cpu).
        attention_backend: a name for get_attention_backend ("auto", "torch", "cpu",
            "triton").
        tp: a tensor-parallel rank's TPGroup: the model gets that rank's slices only
            (conveyor.model.distributed.sharding), each read as a narrow view of the file.
        keep_quantized: a GGUF file's weights of QUANT_TYPES stay in their blocks (CPU
            float32 with the C kernels only; elsewhere everything is dequantized).
        linear_dtype: the dtype of the linears' and the embedding's weights when it differs
            from `dtype`, the dtype of everything else and of the activations (the CPU
            bfloat16 path: bf16 weights, packed by linear.CpuLinear, under float32
            activations). None: `dtype`.
    Returns:
        the model; callers run it under torch.inference_mode().
    Raises:
        ValueError: unknown architecture, unsupported config, missing/unexpected/misshaped
            weights.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    hf_config = read_hf_config(path)
    dtype = resolve_dtype(dtype, device, hf_config)
    backend = get_attention_backend(attention_backend, device)
    return build_model(
        path, hf_config, dtype, device, backend, tp=tp, keep_quantized=keep_quantized,
        linear_dtype=linear_dtype,
    )  # fmt: skip


def build_model(
    path: str | Path,
    hf_config: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    tp: Any = None,
    keep_quantized: bool = False,
    linear_dtype: torch.dtype | None = None,
) -> LlamaForCausalLM:
    """The model of the checkpoint at `path` (its config: `hf_config`), every layer on
    `backend`, in eval mode on `device` and `dtype` (load_model says the rest)."""
    cls = resolve_model_class(hf_config)
    config = model_config(hf_config)
    gguf_file = find_gguf_file(path)
    shard = None if tp is None else Shard.of(config, tp.rank, tp.size, cls.SPEC.tp_splits)
    if gguf_file is not None and shard is not None:
        raise ValueError(
            "tensor_parallel_size > 1 is not supported for GGUF models; use an HF safetensors "
            "checkpoint, or tensor_parallel_size 1."
        )
    kernels = None
    if gguf_file is not None:
        if keep_quantized and device.type == "cpu" and dtype == torch.float32:
            # (a bf16 linear_dtype changes only the weights that are not kept quantized)
            kernels = cpu_kernels.load()
        tensors = iter_gguf_tensors(gguf_file, hf_config, keep_quantized=kernels is not None)
    else:
        files = checkpoint_files(path)
        # Tied when the config says so, or when the checkpoint simply has no lm_head.
        config.tie_word_embeddings = (
            config.tie_word_embeddings or "lm_head.weight" not in _checkpoint_names(files)
        )
        tensors = iter_checkpoint_tensors(files)
        if is_mxfp4(hf_config):
            # the experts stay in their MXFP4 blocks where our C kernels run the linears
            # (not split for tensor parallelism: those ranks get the dequantized weights)
            if keep_quantized and device.type == "cpu" and dtype == torch.float32 and shard is None:
                kernels = cpu_kernels.load()
            tensors = mxfp4_tensors(tensors, kernels is not None, linear_dtype or dtype)
            logger.info(
                "MXFP4 experts: %s.",
                "kept quantized (C kernels)" if kernels is not None else
                f"dequantized to {str(linear_dtype or dtype).removeprefix('torch.')}",
            )  # fmt: skip
    with torch.device("meta"):
        model = cls(config, backend, tp=tp, shard=shard)
    try:
        if gguf_file is not None:
            _log_gguf_paths(gguf_file, kernels is not None)
        assign_weights(model, tensors, dtype, device, shard, kernels, linear_dtype)
    finally:
        if gguf_file is not None:
            release_gguf()
    embed = model.model.embed_tokens
    if model.lm_head is None and isinstance(embed, QuantEmbedding):
        model.lm_head = embed.as_linear()  # tied: the head reads the embedding's blocks
    # Parameters are already in place; this moves the buffers (the rope table) along.
    if linear_dtype in (None, dtype):
        model = model.to(device=device, dtype=dtype)
    else:
        model = model.to(device=device)
        for buf in model.buffers():  # the rope table, in `dtype`
            if buf.is_floating_point():
                buf.data = buf.data.to(dtype)
    return model.eval()


def load_weights(
    path: str | Path,
    hf_config: dict[str, Any],
    settings: LoadSettings,
    config: EngineConfig,
    tp: Any = None,
) -> tuple[LlamaForCausalLM, CpuKernels | None]:
    """Start-up, step 3 (model/runner.py): the runner's model, built (build_model) as
    `settings` say, its linears packed for their GEMM and, on CPU with the C kernels, its
    norms, rotary and decoder layers put on them.

    Returns:
        the model, and the C kernels its forward runs on (None: torch).
    """
    s = settings
    # The weights the C kernels stream every step go on 2 MiB pages (huge_pages.py).
    with huge_page_arena() if s.device.type == "cpu" else contextlib.nullcontext():
        # Our C kernels run the linears: a GGUF file's QUANT_TYPES blocks stay as they are.
        model = build_model(
            path, hf_config, s.dtype, s.device, s.attention_backend, tp=tp,
            keep_quantized=s.linear_backend == "cpu", linear_dtype=s.weight_dtype,
        )  # fmt: skip
        set_activation_passes(model, config.quant_activation_passes)
        if s.linear_backend in ("onednn", "cpu"):
            pack_linears(model, linear_factory(s.linear_backend, s.weight_dtype))
    logger.info("Weights in memory: %.1f MiB.", weight_bytes(model) / 2**20)
    # The norms (residual add fused in), rotary and activation run on the kernels that come
    # with the attention backend's (AttentionBackend.layer_kernels): Triton's on CUDA
    # (conveyor.kernels.fused), or the C library, which also runs the sampler's argmax and
    # whole decoder layers. A backend without any (the torch reference) keeps them in torch.
    layer_kernels = model.attention_backend.layer_kernels
    if layer_kernels == "triton" and s.device.type == "cuda":
        import conveyor.kernels.fused as fused

        use_kernels(model, fused)
        logger.info("Norms, rotary and activation: Triton kernels (conveyor.kernels.fused).")
        use_grouped_gemm(model)
        return model, None
    kernels = cpu_kernels.load() if layer_kernels == "c" else None
    if kernels is None or s.dtype != torch.float32:
        return model, None
    use_kernels(model, kernels)
    if hasattr(model, "fused_layers"):
        model.fused_layers = FusedLayers.build(model, kernels)
        if model.fused_layers is not None:
            logger.info("Decoder layers: one C call a step (csrc/decoder_layers.c).")
    if use_cpu_kernels(model, kernels):
        logger.info("Mixture of experts: a step's experts in one C call (csrc/moe.c).")
    return model, kernels


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each storage once: a tied head counts once)."""
    return storage_bytes([*model.parameters(), *model.buffers()])


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of memory behind `tensors`, each byte counted once: a tied head, views of one
    storage, weights side by side in one huge-page mapping (huge_pages.py). A contiguous
    tensor counts its own bytes, any other its whole storage."""
    mkldnn: dict[int, int] = {}
    spans = []
    for t in tensors:
        if t.is_mkldnn:  # oneDNN's packed weight has no storage to read: its elements
            mkldnn[id(t)] = t.numel() * t.element_size()
        elif t.is_contiguous():
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        else:
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    total, reach = 0, 0
    for start, end in sorted(spans):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total + sum(mkldnn.values())


def _log_gguf_paths(file: Path, keep_quantized: bool) -> None:
    """One line: each tensor type of the file and the path it takes."""
    counts = Counter(t.tensor_type.name for t in open_gguf(file).tensors if len(t.shape) == 2)
    paths = [
        f"{n} x {qtype}: "
        + ("kept quantized (C kernels)" if keep_quantized and qtype in QUANT_TYPES else
           "dequantized to the compute dtype")
        for qtype, n in sorted(counts.items())
    ]  # fmt: skip
    logger.info("GGUF weights (2-D tensors): %s.", "; ".join(paths))

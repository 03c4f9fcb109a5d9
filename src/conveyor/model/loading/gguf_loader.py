"""Read a llama.cpp GGUF file as the loader reads an HF folder: a config.json-shaped dict and
(HF name, tensor) pairs, every quantized tensor dequantized by the `gguf` library, or (with
`keep_quantized`) the weights of quant_linear.QUANT_TYPES kept as the file's blocks
(quant_linear.py). Each family declares its GGUF architecture and tensor names
(FamilySpec.gguf, model/models/spec.py); Llama's, which Qwen2 and Qwen3 share:

    GGUF name                 HF name
    token_embd.weight         model.embed_tokens.weight
    output_norm.weight        model.norm.weight
    output.weight             lm_head.weight (absent: tied embeddings)
    blk.N.attn_norm.*         model.layers.N.input_layernorm.*
    blk.N.ffn_norm.*          model.layers.N.post_attention_layernorm.*
    blk.N.attn_{q,k,v}.*      model.layers.N.self_attn.{q,k,v}_proj.*
    blk.N.attn_output.*       model.layers.N.self_attn.o_proj.*
    blk.N.attn_{q,k}_norm.*   model.layers.N.self_attn.{q,k}_norm.*   (Qwen3)
    blk.N.ffn_{gate,up,down}.* model.layers.N.mlp.{gate,up,down}_proj.*

llama.cpp's converter reorders the rows of a `llama` file's q and k weights (pairs of rotary
dimensions interleaved, GGML's rope layout; `permuted_qk`); they are put back in HF's
half-split order here.
`rope_freqs.weight` (Llama 3.1+ files: the llama3 rope scaling as one factor per frequency,
which llama.cpp divides each frequency by) becomes the config's `rope_freq_factors`.
Qwen2/Qwen3 files keep HF's order. A name outside the table passes through unchanged, so the
loader reports it as an unexpected weight.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from conveyor.model.cpu.quant_linear import QUANT_TYPES, QuantTensor
from conveyor.model.loading.finite_weights import check_gguf_tensor
from conveyor.model.loading.gguf_experts import gguf_expert_config, split_experts
from conveyor.model.loading.gguf_file import GGUFFile
from conveyor.model.loading.gguf_metadata import check_gguf_metadata, describe
from conveyor.model.models import FAMILIES
from conveyor.model.models.spec import GGUFNames

# general.architecture -> the family's names, from the families' declarations.
GGUF_NAMES: dict[str, GGUFNames] = {
    cls.SPEC.gguf.architecture: cls.SPEC.gguf for cls in FAMILIES if cls.SPEC.gguf is not None
}
# general.architecture -> our registry's class name.
GGUF_ARCHITECTURES = {
    cls.SPEC.gguf.architecture: cls.SPEC.architectures[0]
    for cls in FAMILIES
    if cls.SPEC.gguf is not None
}
# Tensor types we dequantize (all that `gguf.quants.dequantize` and our tests cover).
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K")
GGUF_TYPES += ("Q6_K", "MXFP4")

_ROPE_FREQS = "rope_freqs.weight"  # read into the config, not a weight
# llama.cpp writes Mixtral as a `llama` file with experts.
_WITH_EXPERTS = {"llama": "MixtralForCausalLM"}


@functools.lru_cache(maxsize=1)
def _reader(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(file: str | os.PathLike[str]) -> GGUFFile:
    """The parsed file, once per file version: the config and the weights come from one
    parse (the runner reads the config before it loads the weights)."""
    stat = os.stat(file)
    return _reader(str(file), stat.st_mtime_ns, stat.st_size)


def release_gguf() -> None:
    """Drop the cached reader (and its memory map) once the weights are loaded."""
    _reader.cache_clear()


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def read_gguf_config(file: str | os.PathLike[str]) -> dict[str, Any]:
    """A config.json-shaped dict from the file's metadata.

    "dtype" is the weights' own precision: bfloat16 / float16 / float32 for unquantized
    files, float16 for quantized ones (their block scales are float16). It is what
    dtype="auto" follows on CUDA.

    Raises:
        ValueError: an architecture, tensor type or rope scaling we do not support, or
            metadata that does not match the tensors (model/loading/gguf_metadata.py).
    """
    reader = open_gguf(file)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {file} has architecture {describe(arch)}; conveyor loads "
            f"{', '.join(GGUF_ARCHITECTURES)} GGUF files."
        )
    types = {}
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name not in GGUF_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name} in {file} is {name}, which conveyor cannot "
                f"dequantize; supported types: {', '.join(GGUF_TYPES)}. Convert the file with "
                "llama.cpp's llama-quantize to one of them."
            )
        if len(tensor.shape) >= 2:
            types[name] = types.get(name, 0) + 1
    gguf = GGUF_NAMES[arch]
    names = {gguf.hf_name(t.name) for t in reader.tensors}
    shape = check_gguf_metadata(file, reader, arch, gguf.gguf_name)
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "gguf_architecture": arch,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": "lm_head.weight" not in names,
        "attention_bias": gguf.bias_from_tensors
        and "model.layers.0.self_attn.q_proj.bias" in names,
        "dtype": _dtype_name(types),
    }
    experts = gguf_expert_config(file, reader, arch, shape.hidden_size)
    if experts:
        config.update(experts)
        if arch in _WITH_EXPERTS:
            config["architectures"] = [_WITH_EXPERTS[arch]]
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if not isinstance(scaling, (str, type(None))):
        raise ValueError(
            f"GGUF file {file}: {arch}.rope.scaling.type is {describe(scaling)}; it must be "
            "a string ('none' or 'linear')."
        )
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(
                f"GGUF file {file} uses {scaling!r} rope scaling; conveyor applies only linear "
                "rope scaling to GGUF files."
            )
        config["rope_scaling"] = {"rope_type": "linear", "factor": shape.rope_scaling_factor}
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        config["rope_freq_factors"] = _rope_freq_factors(file, freqs, config["head_dim"])
    if shape.sliding_window:
        config["sliding_window"] = shape.sliding_window
    return config


def _rope_freq_factors(file: str | os.PathLike[str], tensor: Any, head_dim: int) -> list[float]:
    """rope_freqs.weight's factors, one per rotary frequency (head_dim // 2 of them)."""
    from gguf.quants import dequantize

    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float64).reshape(-1)
    if values.size != head_dim // 2 or not np.all(values > 0):
        raise ValueError(
            f"GGUF file {file}: rope_freqs.weight has {values.size} values; conveyor needs "
            f"{head_dim // 2} positive factors (one per frequency of head size {head_dim})."
        )
    return values.tolist()


def _dtype_name(types: dict[str, int]) -> str:
    if set(types) <= {"F32"}:
        return "float32"
    if set(types) <= {"BF16", "F32"}:
        return "bfloat16"
    return "float16"


def iter_gguf_tensors(
    file: str | os.PathLike[str], config: dict[str, Any], keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """(HF name, tensor) for every tensor of the file, one at a time: a float32 CPU tensor
    (dequantized), or with `keep_quantized` a QuantTensor of the file's blocks for every 2-D
    weight of a type in QUANT_TYPES (the linears and the embedding). A tensor holding a value
    that is not finite (model/loading/finite_weights.py) raises ValueError.

    Args:
        config: `read_gguf_config(file)` (for the head counts that undo llama's q/k order).
        keep_quantized: keep QUANT_TYPES' blocks as they are (quant_linear.py runs them).
    """
    from gguf.quants import dequantize

    reader = open_gguf(file)
    gguf = GGUF_NAMES[config["gguf_architecture"]]
    # The permuted q and k weights' head counts, by HF module leaf.
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        check_gguf_tensor(file, tensor)  # NaN or inf: refused, named (finite_weights.py)
        qtype = tensor.tensor_type.name
        experts = len(tensor.shape) == 3  # [E, rows, cols]: one weight per expert
        quantized = keep_quantized and qtype in QUANT_TYPES and len(tensor.shape) - experts == 2
        # copy=True: never alias the read-only memory map (it is closed after the load).
        if quantized:  # the rows' bytes as they are: [rows, row bytes]
            values = np.array(tensor.data, np.uint8, copy=True)
        else:  # dequantize returns float32
            values = np.array(dequantize(tensor.data, tensor.tensor_type), np.float32, copy=True)
        reader.drop_pages(tensor)  # copied: the file's pages need not stay resident
        per_expert = split_experts(tensor.name, values, gguf.experts) if gguf.experts else None
        if experts and per_expert is not None:
            for name, part in per_expert:
                data = torch.from_numpy(part)
                yield name, QuantTensor(qtype, data, tensor.shape[1:]) if quantized else data
            continue
        name = gguf.hf_name(tensor.name)
        module = name.split(".")[-2] if name.startswith("model.layers.") else ""
        if gguf.permuted_qk and module in heads:
            values = _unpermute_rows(values, heads[module])  # whole rows either way
        data = torch.from_numpy(values)
        yield name, QuantTensor(qtype, data, tensor.shape) if quantized else data


def _unpermute_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order [d0, d_half, d1, d_half+1, ...] -> [first half,
    second half] (rows of a q/k weight or bias)."""
    rows = values.shape[0]
    half = rows // num_heads // 2
    grouped = values.reshape(num_heads, half, 2, *values.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(values.shape)

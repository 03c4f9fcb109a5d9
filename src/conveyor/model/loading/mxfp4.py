"""HF MXFP4 checkpoints (gpt-oss as released: config.json's quantization_config has
quant_method "mxfp4") read as the loader reads any safetensors checkpoint.

Such a checkpoint stores each expert stack `<stack>` (gpt-oss: `mlp.experts.gate_up_proj`
and `mlp.experts.down_proj`) as two uint8 tensors; every other weight is bfloat16:

    <stack>_blocks  [E, rows, cols / 32, 16]  a group of 32 weights of a row in 16 bytes:
                                              weight 2i in byte i's low nibble, 2i + 1 in
                                              its high nibble (E2M1 codes, FP4_VALUES)
    <stack>_scales  [E, rows, cols / 32]      the group's E8M0 exponent byte s: each weight
                                              is FP4_VALUES[code] * 2^(s - 127)

rows is the output dimension (nn.Linear's orientation; the bf16 checkpoints' dense stacks are
[E, cols, rows], transformers' parameter layout). `mxfp4_tensors` turns each pair into one
tensor named `<stack>`:

    kept quantized (CPU float32 with the C kernels): a QuantExperts of GGUF's MXFP4 blocks,
        17 bytes a group: the scale byte, then weight j in byte j's low nibble and weight
        16 + j in its high one. GGUF's value table is E2M1 doubled and its scale 2^(s - 128),
        so the scale byte carries over as it is and only the nibbles move; one kernel
        (csrc's MXFP4 dot products) then serves HF and GGUF files. The family's unstack
        (models/gpt_oss.py) cuts it into each expert's QuantTensors.
    dequantized (CUDA, the torch and oneDNN linears, bf16 models, tensor parallelism): the
        dense [E, cols, rows] stack a bf16 checkpoint has, in the weights' dtype (every
        MXFP4 value is exact in bfloat16 and float32).

A scale byte that makes a weight that is not finite in float32 (0xFF, E8M0's NaN, or 2^126
and up times a large enough value) is refused, as finite_weights.py refuses such values.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from conveyor.model.cpu.quant_linear import QUANT_TYPES, QuantExperts
from conveyor.model.loading.finite_weights import describe_e8m0, first_bad_e8m0
from conveyor.model.loading.safetensors_mmap import MappedTensor

# The E2M1 value of each 4-bit code (sign, two exponent bits, one mantissa bit).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
GROUP = 32  # weights per scale
_SUFFIXES = ("_blocks", "_scales")


def is_mxfp4(hf_config: dict[str, Any]) -> bool:
    """Whether config.json says the checkpoint's experts are MXFP4."""
    quant = hf_config.get("quantization_config")
    return isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "mxfp4"


def to_gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF's groups (uint8 blocks [..., G, 16], scales [..., G]) as GGUF MXFP4 blocks, uint8
    [..., G * 17]: the same values, the nibbles reordered. GGUF's byte j holds codes j and
    16 + j, which are in HF's bytes j / 2 and 8 + j / 2, each the nibble of j's parity."""
    out = torch.empty(*blocks.shape[:-1], 17, dtype=torch.uint8)
    first, second = blocks[..., :8], blocks[..., 8:]  # codes 0 .. 15, 16 .. 31
    out[..., 0] = scales
    out[..., 1::2] = (first & 15) | (second << 4)  # even j: the low nibbles
    out[..., 2::2] = (first >> 4) | (second & 0xF0)  # odd j: the high ones
    return out.flatten(-2)


# Each byte of HF's blocks as its two values in order (low nibble first).
_PAIRS = torch.tensor(FP4_VALUES)[torch.stack([torch.arange(256) & 15, torch.arange(256) >> 4], 1)]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """HF's groups (uint8 blocks [..., G, 16], scales [..., G]) as weights [..., G * 32] in
    `dtype`: FP4_VALUES[code] * 2^(scale - 127), rounded once (exact in bf16 and float32)."""
    values = _PAIRS[blocks.long()].flatten(-2)  # [..., G, 32] float32
    scale = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 127)
    return (values * scale.unsqueeze(-1)).to(dtype).flatten(-2)


def _check_pair(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """One-line ValueErrors for a pair that is not MXFP4 groups of 32."""
    where = f"MXFP4 checkpoint: {name}"
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"{where}_blocks and _scales must be uint8, got {blocks.dtype} and {scales.dtype}."
        )
    if blocks.dim() != 4 or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"{where}_blocks has shape {list(blocks.shape)}; MXFP4 experts are "
            f"[experts, rows, groups, {GROUP // 2}] (two weights a byte, {GROUP} a group)."
        )
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"{where}_scales has shape {list(scales.shape)}; its _blocks "
            f"{list(blocks.shape)} need one scale a group: {list(blocks.shape[:-1])}."
        )
    bad = first_bad_e8m0(scales.reshape(-1).numpy(), blocks.reshape(-1, GROUP // 2).numpy())
    if bad is not None:
        at = list(np.unravel_index(bad[0], tuple(scales.shape)))
        raise ValueError(
            f"{where}_scales holds {describe_e8m0(bad[1])} at {[int(i) for i in at]}; a model "
            "with a value that is not finite answers only errors. The file is damaged."
        )


def _convert(
    name: str, blocks: torch.Tensor, scales: torch.Tensor, keep: bool, dtype: torch.dtype
) -> QuantExperts | torch.Tensor:
    """The stack `name` from its pair, one expert at a time (bounds the temporaries)."""
    _check_pair(name, blocks, scales)
    experts, rows, groups, _ = blocks.shape
    cols = groups * GROUP
    if keep:
        data = torch.empty(experts, rows, groups * QUANT_TYPES["MXFP4"][2], dtype=torch.uint8)
        for e in range(experts):
            data[e] = to_gguf_blocks(blocks[e], scales[e])
        return QuantExperts("MXFP4", data, (experts, rows, cols))
    dense = torch.empty(experts, rows, cols, dtype=dtype)
    for e in range(experts):
        dense[e] = dequantize(blocks[e], scales[e], dtype)
    return dense.transpose(1, 2)  # [E, cols, rows], as the bf16 checkpoints store a stack


def mxfp4_tensors(
    tensors: Iterator[tuple[str, Any]], keep: bool, dtype: torch.dtype
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each `<stack>_blocks` / `<stack>_scales` pair replaced by
    one `<stack>` (the module docstring): a QuantExperts when `keep`, else a dense stack in
    `dtype`. Every other tensor passes through.

    Raises:
        ValueError: a pair of the wrong dtype or shape, a scale that is E8M0's NaN, or one
            half of a pair missing from the checkpoint.
    """
    pending: dict[str, dict[str, Any]] = {}  # stack -> the half seen so far
    for name, item in tensors:
        stack, suffix = name[:-7], name[-7:]
        if suffix not in _SUFFIXES:
            yield name, item
            continue
        pair = pending.setdefault(stack, {})
        pair[suffix] = item
        if len(pair) < 2:
            continue
        del pending[stack]
        halves = [pair[s] for s in _SUFFIXES]
        views = [h.tensor if isinstance(h, MappedTensor) else h for h in halves]
        converted = _convert(stack, *views, keep, dtype)
        for half in halves:
            if isinstance(half, MappedTensor):  # copied: the file's pages can go
                half.release()
        yield stack, converted
    for stack, pair in pending.items():
        (have,) = pair
        want = _SUFFIXES[1] if have == _SUFFIXES[0] else _SUFFIXES[0]
        raise ValueError(
            f"MXFP4 checkpoint: {stack}{have} has no {stack}{want}; each expert stack needs "
            "both its _blocks and its _scales."
        )

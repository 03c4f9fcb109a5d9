"""GGUF weights kept quantized: linear layers and the embedding on the file's own blocks.

A GGUF file's Q8_0, Q4_0, Q4_1 tensors and the K-quants Q4_K, Q5_K and Q6_K (Q4_K_M's
types) stay in memory as the file has them (4.5 to 8.5 bits a weight instead of fp32's 32)
and run through csrc/quant_linear.c (and quant_k.c): each step quantizes the activations per
block of 32 to 8 bits and takes integer dot products with the weight blocks (the formats' own
design; the kernels' headers have the arithmetic). Other types (Q5_0, Q2_K, F16, BF16, ...)
are dequantized at load as before, with a log line saying so.

    QuantTensor     a weight's blocks: uint8 [rows, row bytes], its type and (rows, cols)
    QuantLinear     y = x @ W.T + b over one or more QuantTensors stacked by rows (a fused
                    qkv or gate/up, whose pieces may differ in type)
    QuantEmbedding  the lookup: the ids' rows dequantized to float32; as the tied output
                    head it is a QuantLinear over the same bytes (no copy)

Used when linear_backend resolves to "cpu" (our C kernels) on a CPU in float32; with "torch"
or "onednn" every GGUF tensor is dequantized, which is the reference the tests hold these to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

# Types kept quantized: GGML's type id, weights per block and bytes per block.
QUANT_TYPES = {
    "Q8_0": (8, 32, 34),
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
BLOCK = 32  # activations are quantized per 32
_Q8A_BYTES = 40  # one activation block: float d, float s, int8 q[32]


@dataclass(frozen=True)
class QuantTensor:
    """One GGUF weight's blocks, rows of cols // (the type's block size) blocks each."""

    qtype: str
    data: torch.Tensor  # uint8 [rows, row bytes], contiguous
    shape: tuple[int, int]  # (rows, cols) in weights

    def __post_init__(self) -> None:
        rows, cols = self.shape
        _, size, block_bytes = QUANT_TYPES[self.qtype]
        if cols % size:
            raise ValueError(f"{self.qtype} rows hold blocks of {size}, got {cols} columns.")
        if tuple(self.data.shape) != (rows, cols // size * block_bytes):
            raise ValueError(
                f"{self.qtype} weight of shape {self.shape} needs uint8 rows of "
                f"{cols // size * block_bytes} bytes, got {tuple(self.data.shape)}."
            )

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] weight (gguf's reference dequantizer)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.data.numpy(), GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.array(values, np.float32, copy=True).reshape(self.shape))


def _stacked(parts: list[QuantTensor]) -> tuple[int, int]:
    cols = {p.shape[1] for p in parts}
    if len(cols) != 1:
        raise ValueError(f"quantized pieces of one weight differ in width: {sorted(cols)}.")
    return sum(p.shape[0] for p in parts), cols.pop()


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W's rows in GGUF blocks (inference only, CPU float32 x).

    Args:
        parts: the weight's row ranges, top to bottom (one, or a fused weight's pieces).
        bias: None, or the bias parameter (the loader may assign it later).
        kernels: the loaded CpuKernels.
        passes: 2 (default): the activations in two 8-bit passes (the second one the first's
            rounding error), near fp32's results; 1: one pass, llama.cpp's arithmetic
            (csrc/quant_linear.c's header compares them).
    """

    def __init__(
        self,
        parts: list[QuantTensor],
        bias: nn.Parameter | None,
        kernels: Any,
        passes: int = 2,
    ) -> None:
        super().__init__()
        if passes not in (1, 2):
            raise ValueError(f"passes must be 1 or 2, got {passes}.")
        self.passes = passes
        self.out_features, self.in_features = _stacked(parts)
        self.qtypes = [p.qtype for p in parts]
        self.rows = [p.shape[0] for p in parts]
        for i, part in enumerate(parts):
            self.register_buffer(f"qweight{i}", part.data, persistent=False)
        self.bias = bias
        self._quantize = kernels.fns["conveyor_quantize_q8a_f32"]
        self._linear = kernels.fns["conveyor_quant_linear_f32"]

    def parts(self) -> list[QuantTensor]:
        """The weight's QuantTensors (views of this module's buffers)."""
        return [
            QuantTensor(t, getattr(self, f"qweight{i}"), (n, self.in_features))
            for i, (t, n) in enumerate(zip(self.qtypes, self.rows, strict=True))
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
            raise ValueError(
                f"QuantLinear takes float32 CPU [..., {k}], got {x.dtype} {tuple(x.shape)}."
            )
        rows = x.reshape(-1, k)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        m, threads = rows.shape[0], torch.get_num_threads()
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        if m:
            xq = torch.empty(self.passes, m, k // BLOCK * _Q8A_BYTES, dtype=torch.uint8)
            self._quantize(
                rows.data_ptr(), rows.stride(0), m, k, xq.data_ptr(), self.passes, threads
            )
            bias = None if self.bias is None else self.bias.detach().float().contiguous()
            start = 0
            for i, (qtype, n) in enumerate(zip(self.qtypes, self.rows, strict=True)):
                w = getattr(self, f"qweight{i}")
                failed = self._linear(
                    QUANT_TYPES[qtype][0], w.data_ptr(), w.stride(0), n, k, xq.data_ptr(), m,
                    self.passes, None if bias is None else bias.data_ptr() + 4 * start,
                    out.data_ptr() + 4 * start, self.out_features, threads,
                )  # fmt: skip
                if failed:
                    raise ValueError(f"the quantized kernel does not handle {qtype}.")
                start += n
        return out.view(*x.shape[:-1], self.out_features)


class QuantEmbedding(nn.Module):
    """The token embedding on a GGUF weight's blocks: each id's row dequantized on lookup."""

    def __init__(self, weight: QuantTensor, kernels: Any) -> None:
        super().__init__()
        self.qtype = weight.qtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("qweight", weight.data, persistent=False)
        self._rows = kernels.fns["conveyor_quant_rows_f32"]
        self._kernels = kernels

    def as_linear(self) -> QuantLinear:
        """The tied output head: logits = hidden @ E.T over the same bytes."""
        part = QuantTensor(self.qtype, self.qweight, (self.num_embeddings, self.embedding_dim))
        return QuantLinear([part], None, self._kernels)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.float32)
        failed = self._rows(
            QUANT_TYPES[self.qtype][0], self.qweight.data_ptr(), self.qweight.stride(0),
            self.num_embeddings, self.embedding_dim, flat.data_ptr(), flat.numel(),
            out.data_ptr(), self.embedding_dim,
        )  # fmt: skip
        if failed == 2:
            raise ValueError(f"a token id is outside the vocabulary [0, {self.num_embeddings}).")
        if failed:
            raise ValueError(f"the quantized kernel does not handle {self.qtype}.")
        return out.view(*ids.shape, self.embedding_dim)


def quantized_module(module: nn.Module, parts: list[QuantTensor], kernels: Any) -> nn.Module:
    """The quantized stand-in for `module` (an nn.Linear or nn.Embedding) holding `parts`.

    Raises:
        ValueError: pieces whose stacked shape is not the module's weight shape.
    """
    rows, cols = _stacked(parts)
    if isinstance(module, nn.Embedding):
        want = (module.num_embeddings, module.embedding_dim)
        if (rows, cols) != want or len(parts) != 1:
            raise ValueError(f"embedding weight has shape {(rows, cols)}, expected {want}.")
        return QuantEmbedding(parts[0], kernels)
    want = (module.out_features, module.in_features)
    if (rows, cols) != want:
        raise ValueError(f"weight has shape {(rows, cols)}, expected {want}.")
    return QuantLinear(parts, module.bias, kernels)

"""GGUF weights kept quantized: linear layers and the embedding on the file's own blocks.

A GGUF file's Q8_0, Q4_0, Q4_1 and MXFP4 tensors and the K-quants Q4_K, Q5_K and Q6_K
(Q4_K_M's types) stay in memory as the file has them (4.25 to 8.5 bits a weight instead of
fp32's 32), and so do an HF MXFP4 checkpoint's experts, repacked into GGUF's MXFP4 blocks at
load (loading/mxfp4.py); they run through csrc/quant_linear.c (the dot products in
quant_x8_*.c and quant_k_*.c): each
step quantizes the activations per block of 32 to 8 bits and takes integer dot products with
the weight blocks (the formats' own design; the kernels' headers have the arithmetic). Other
types (Q5_0, Q2_K, F16, BF16, ...) are dequantized at load as before, with a log line saying
so.

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

from conveyor.model.cpu.huge_pages import arena_empty

# Types kept quantized: GGML's type id, weights per block and bytes per block.
QUANT_TYPES = {
    "Q8_0": (8, 32, 34),
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "MXFP4": (39, 32, 17),  # an E8M0 scale byte and 16 bytes of E2M1 nibbles
}
BLOCK = 32  # activations are quantized per 32
# From this many rows of x (a long prefill chunk) a QuantLinear stops running the integer
# kernels, whose cost grows with every row, and dequantizes its weight a slice at a time into
# a GEMM instead: bf16 panels through gemm.c's vdpbf16ps GEMM on a build with AVX512-BF16
# (csrc/quant_gemm.c; faster than the AVX-512 integer kernels' two passes from 256 rows on),
# float32 through oneDNN's GEMM on AVX2 and portable builds, where the
# integer kernels take one activation row at a time. AVX-512 without BF16 keeps its tiled
# integer kernels, which beat the float32 GEMM at every row count
# (docs/kernels.md#measured-choices).
GEMM_ROWS = 256
_GEMM_SLICE = 1024  # weight rows dequantized at a time (1024 x 4096 floats: 16 MiB)
_PANEL_SLICE_BYTES = 16 << 20  # bf16 panels per GEMM call of the AVX512-BF16 path
_Q8A_BYTES = 40  # one activation block: float d, float s, int8 q[32]


def q8a_bytes(passes: int, rows: int, k: int) -> int:
    """Bytes of `rows` activation rows of width k quantized for the integer kernels."""
    return passes * rows * (k // BLOCK) * _Q8A_BYTES


# Every kept type runs on rows interleaved GROUP at a time (interleave_groups): bytes per
# block of such a group (the K-quants' 6-bit scales decoded to bytes: 2-3% more).
GROUP = 16  # csrc/kernels.h's QG
_GROUP_BYTES = {"Q8_0": 544, "Q4_0": 288, "Q4_1": 320, "Q4_K": 2368, "Q5_K": 2880, "Q6_K": 3360}
_GROUP_BYTES["MXFP4"] = 272
# Activation rows that share one pass over a group's unpacked weights (csrc's QT).
MAX_TILE = 4


@dataclass(frozen=True)
class QuantTensor:
    """One GGUF weight's blocks: rows of cols // (the type's block size) blocks each, as the
    file has them, or (`interleaved`) as interleave_groups reorders them for the kernels."""

    qtype: str
    data: torch.Tensor  # uint8 [rows, row bytes] (interleaved: [ceil(rows / 16), group bytes])
    shape: tuple[int, int]  # (rows, cols) in weights
    interleaved: bool = False

    def __post_init__(self) -> None:
        rows, cols = self.shape
        _, size, block_bytes = QUANT_TYPES[self.qtype]
        if cols % size:
            raise ValueError(f"{self.qtype} rows hold blocks of {size}, got {cols} columns.")
        want = (rows, cols // size * block_bytes)
        if self.interleaved:
            want = (-(-rows // GROUP), cols // size * _GROUP_BYTES[self.qtype])
        if tuple(self.data.shape) != want:
            raise ValueError(
                f"{self.qtype} weight of shape {self.shape} needs uint8 "
                f"{'groups' if self.interleaved else 'rows'} of {want[1]} bytes, got "
                f"{tuple(self.data.shape)}."
            )

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] weight (gguf's reference dequantizer)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if self.interleaved:
            raise ValueError("dequantize the weight before interleave_groups.")
        values = dequantize(self.data.numpy(), GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.array(values, np.float32, copy=True).reshape(self.shape))


@dataclass(frozen=True)
class QuantExperts:
    """A stack of experts' weights in GGUF blocks (an HF MXFP4 checkpoint's, repacked at load:
    loading/mxfp4.py), each expert's [rows, cols] weight in nn.Linear's orientation; the
    family's unstack cuts it into QuantTensors (`expert`)."""

    qtype: str
    data: torch.Tensor  # uint8 [experts, rows, row bytes]
    shape: tuple[int, int, int]  # (experts, rows, cols) in weights

    def expert(self, e: int, rows: slice = slice(None)) -> QuantTensor:
        """Expert e's weight, or the rows `rows` of it (gpt-oss's interleaved gate and up),
        as a QuantTensor of its own bytes."""
        data = self.data[e, rows].contiguous()
        return QuantTensor(self.qtype, data, (data.shape[0], self.shape[2]))


def _side(fields: np.ndarray, width: int) -> np.ndarray:
    """[groups, GROUP rows, blocks, F * width] -> [groups, blocks, F * GROUP * width]: each
    of the F fields (of `width` bytes) of the group's rows side by side."""
    g, _, n, length = fields.shape
    split = fields.reshape(g, GROUP, n, length // width, width).transpose(0, 2, 3, 1, 4)
    return split.reshape(g, n, GROUP * length)


def _quads(runs: np.ndarray, run: int) -> np.ndarray:
    """[groups, GROUP rows, blocks, R * run] -> [groups, blocks, GROUP * R * run]: each run of
    `run` bytes as quads: four bytes of each of the group's rows side by side, run // 4
    times."""
    g, _, n, length = runs.shape
    split = runs.reshape(g, GROUP, n, length // run, run // 4, 4).transpose(0, 2, 3, 4, 1, 5)
    return split.reshape(g, n, GROUP * length)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and minimums -> (scales[8], minimums[8])."""
    q = packed.astype(np.uint8)
    lo_sc, lo_m = q[..., 0:4] & 63, q[..., 4:8] & 63
    hi_sc = (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)
    hi_m = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return np.concatenate([lo_sc, hi_sc], -1), np.concatenate([lo_m, hi_m], -1)


def _interleaved_pieces(qtype: str, b: np.ndarray) -> list[np.ndarray]:
    """A group's blocks b [groups, GROUP, blocks, block bytes] in csrc's interleaved order."""
    if qtype == "Q8_0":  # the quants + 128, unsigned (csrc/quant_layout.h)
        return [_side(b[..., 0:2], 2), _quads(b[..., 2:34] ^ np.uint8(128), 32)]
    if qtype == "Q4_0":
        return [_side(b[..., 0:2], 2), _quads(b[..., 2:18], 16)]
    if qtype == "Q4_1":
        return [_side(b[..., 0:2], 2), _side(b[..., 2:4], 2), _quads(b[..., 4:20], 16)]
    if qtype == "MXFP4":  # the E8M0 scale bytes, then the nibbles as Q4_0's
        return [_side(b[..., 0:1], 1), _quads(b[..., 1:17], 16)]
    if qtype == "Q6_K":  # ql, qh, sc, d -> d, sc, ql, qh
        return [_side(b[..., 208:210], 2), _side(b[..., 192:208], 1),
                _quads(b[..., 0:128], 32), _quads(b[..., 128:192], 32)]  # fmt: skip
    scales, mins = _k_scales(b[..., 4:16])
    pieces = [_side(b[..., 0:2], 2), _side(b[..., 2:4], 2), _side(scales, 1), _side(mins, 1)]
    if qtype == "Q5_K":
        pieces.append(_quads(b[..., 16:48], 32))
    return [*pieces, _quads(b[..., -128:], 32)]


def gemm_rows(kernels: Any) -> int | None:
    """The row count from which a QuantLinear on `kernels` dequantizes its weight into a GEMM
    (bf16 with AVX512-BF16, float32 on AVX2 and portable builds), or None: the integer
    kernels take every row count."""
    return None if kernels.linear_isa == "avx512" else GEMM_ROWS


def interleave_groups(weight: QuantTensor) -> QuantTensor:
    """A weight's bytes as csrc/quant_layout.h lays them out: uint8 [ceil(rows / 16),
    group bytes], each group of sixteen rows (zero rows pad the last) block by block, each
    block's fields for the group's rows side by side (the kernels' headers give the layouts).
    The file's bytes reordered (the K-quants' packed 6-bit scales decoded to bytes, Q8_0's
    quants offset by 128)."""
    if weight.interleaved:
        return weight
    rows, cols = weight.shape
    _, size, block_bytes = QUANT_TYPES[weight.qtype]
    nb, groups = cols // size, -(-rows // GROUP)
    blocks = np.zeros((groups * GROUP, nb, block_bytes), np.uint8)
    blocks[:rows] = weight.data.numpy().reshape(rows, nb, block_bytes)
    pieces = _interleaved_pieces(weight.qtype, blocks.reshape(groups, GROUP, nb, block_bytes))
    # Written into a torch allocation (in the huge-page arena while a model loads:
    # huge_pages.py): 64-byte aligned, as the kernels' 64-byte loads of a group's quads want
    # (numpy's 16-byte alignment split every load across two cache lines, which made the
    # kernels far slower: docs/kernels.md#measured-choices).
    data = arena_empty((groups, nb * _GROUP_BYTES[weight.qtype]), torch.uint8)
    np.concatenate(pieces, axis=2, out=data.numpy().reshape(groups, nb, -1))
    return QuantTensor(weight.qtype, data, weight.shape, interleaved=True)


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
            self.register_buffer(f"qweight{i}", interleave_groups(part).data, persistent=False)
        self.bias = bias
        # Activation rows per pass over the unpacked weights (1 .. MAX_TILE; 1: one row at a
        # time, the path before tiles, kept for tests and benchmarks: the same results).
        self.max_tile = MAX_TILE
        self.gemm_rows = gemm_rows(kernels)  # None: never the dequantized GEMM
        # the GEMM on bf16 panels (quant_gemm.c) where the build has vdpbf16ps
        self._bf16_gemm = kernels.fns.get("gemm_gguf_bf16")
        self._quantize = kernels.fns["quantize_q8a_f32"]
        self._linear = kernels.fns["gemm_gguf_q8a"]
        self._rows = kernels.fns["rows_gguf_f32"]

    def _apply(self, fn, recurse=True):  # .to() and friends may move the buffers
        self._plan = None
        return super()._apply(fn, recurse)

    def _launches(self) -> list[tuple[int, int, int, int, int | None, int]]:
        """Per piece: (type id, weight address, its row or group stride, rows, bias address
        or None, the output column it starts at). Built at the first call (the loader may
        assign the bias after the module is made) and kept: the calls are per token."""
        if getattr(self, "_plan", None) is None:
            bias = self.bias
            if bias is not None:
                self._bias = bias.detach().float().contiguous()  # kept alive with the plan
            plan, start = [], 0
            for i, (qtype, n) in enumerate(zip(self.qtypes, self.rows, strict=True)):
                w = getattr(self, f"qweight{i}")
                b = None if bias is None else self._bias.data_ptr() + 4 * start
                plan.append((QUANT_TYPES[qtype][0], w.data_ptr(), w.stride(0), n, b, start))
                start += n
            self._plan = plan
        return self._plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
            raise ValueError(
                f"QuantLinear takes float32 CPU [..., {k}], got {x.dtype} {tuple(x.shape)}."
            )
        rows = x.reshape(-1, k)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        m, threads, passes = rows.shape[0], torch.get_num_threads(), self.passes
        if self.gemm_rows is not None and m >= self.gemm_rows:
            return self._gemm(rows, threads).view(*x.shape[:-1], self.out_features)
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        if m:
            xq = torch.empty(q8a_bytes(passes, m, k), dtype=torch.uint8)
            xq_ptr, out_ptr, ldo = xq.data_ptr(), out.data_ptr(), self.out_features
            self._quantize(rows.data_ptr(), rows.stride(0), m, k, xq_ptr, passes, threads)
            for type_id, w, ldw, n, bias, start in self._launches():
                failed = self._linear(
                    type_id, w, ldw, n, k, xq_ptr, m, passes, bias, out_ptr + 4 * start, ldo,
                    threads, self.max_tile,
                )  # fmt: skip
                if failed == 3:
                    raise MemoryError("the quantized kernel could not allocate its sums.")
                if failed:
                    raise ValueError(f"the quantized kernel does not handle type {type_id}.")
        return out.view(*x.shape[:-1], self.out_features)

    def _gemm(self, rows: torch.Tensor, threads: int) -> torch.Tensor:
        """x @ W.T + b through a GEMM on W dequantized a slice at a time: bf16 panels through
        vdpbf16ps (x and W rounded to bf16, float32 sums) where the build has it, else
        float32 (exact: no activation quantization)."""
        if self._bf16_gemm is not None:
            return self._gemm_bf16(rows, threads)
        k = self.in_features
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        weight = torch.empty(min(_GEMM_SLICE, max(self.rows)), k, dtype=torch.float32)
        for type_id, w, ldw, n, _, start in self._launches():
            for j in range(0, n, _GEMM_SLICE):
                ids = torch.arange(j, min(n, j + _GEMM_SLICE), dtype=torch.int64)
                part = weight[: ids.numel()]
                if self._rows(
                    type_id, w, ldw, n, k, ids.data_ptr(), ids.numel(), part.data_ptr(), k,
                    threads,
                ):  # fmt: skip
                    raise ValueError(f"the quantized kernel does not handle type {type_id}.")
                at = start + j
                out[:, at : at + ids.numel()] = rows @ part.T
        if self.bias is not None:
            out += self._bias
        return out

    def _gemm_bf16(self, rows: torch.Tensor, threads: int) -> torch.Tensor:
        m, k, ldo = rows.shape[0], self.in_features, self.out_features
        out = torch.empty(m, ldo, dtype=torch.float32)
        for type_id, w, ldw, n, bias, start in self._launches():
            failed = self._bf16_gemm(
                type_id, w, ldw, n, k, rows.data_ptr(), rows.stride(0), m, bias,
                out.data_ptr() + 4 * start, ldo, _PANEL_SLICE_BYTES, threads,
            )  # fmt: skip
            if failed == 3:
                raise MemoryError("the bf16 GEMM could not allocate its weight panels.")
            if failed:  # 1: a type it does not take
                raise ValueError(f"the bf16 GEMM cannot run type {type_id} here (code {failed}).")
        return out


class QuantEmbedding(nn.Module):
    """The token embedding on a GGUF weight's blocks: each id's row dequantized on lookup."""

    def __init__(self, weight: QuantTensor, kernels: Any) -> None:
        super().__init__()
        self.qtype = weight.qtype
        self.num_embeddings, self.embedding_dim = weight.shape
        weight = interleave_groups(weight)  # as the tied head will read it
        self.interleaved = weight.interleaved
        self.register_buffer("qweight", weight.data, persistent=False)
        self._rows = kernels.fns["rows_gguf_f32"]
        self._kernels = kernels

    def as_linear(self) -> QuantLinear:
        """The tied output head: logits = hidden @ E.T over the same bytes."""
        shape = (self.num_embeddings, self.embedding_dim)
        part = QuantTensor(self.qtype, self.qweight, shape, self.interleaved)
        return QuantLinear([part], None, self._kernels)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.float32)
        failed = self._rows(
            QUANT_TYPES[self.qtype][0], self.qweight.data_ptr(), self.qweight.stride(0),
            self.num_embeddings, self.embedding_dim, flat.data_ptr(), flat.numel(),
            out.data_ptr(), self.embedding_dim, torch.get_num_threads(),
        )  # fmt: skip
        if failed == 2:
            raise ValueError(f"a token id is outside the vocabulary [0, {self.num_embeddings}).")
        if failed:
            raise ValueError(f"the quantized kernel does not handle {self.qtype}.")
        return out.view(*ids.shape, self.embedding_dim)


def set_activation_passes(model: nn.Module, passes: int) -> None:
    """Every QuantLinear of `model` (the tied head too) quantizes its activations in
    `passes` (1 or 2) passes."""
    if passes not in (1, 2):
        raise ValueError(f"quant_activation_passes must be 1 or 2, got {passes}.")
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.passes = passes


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

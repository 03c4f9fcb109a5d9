"""CPU GEMMs with each weight packed once, at load: our C kernel or oneDNN.

`nn.Linear` on CPU calls MKL's sgemm, which re-blocks the weight on every call; at the row
counts of a decode step (one row per running sequence) that costs more than the
multiplication. Both packed backends lay the weight out once:

- "cpu" (CpuLinear): panels of 16 output columns, float32 or bfloat16, for csrc/gemm.c's
  kernel, which streams each weight once per step and keeps a block of outputs in
  registers: AVX-512 (16 rows x 16 columns of zmm) or AVX2 (6 x 16) by what the build has,
  bf16 panels through vdpbf16ps where the CPU has AVX512-BF16 (x rounded to bf16 then), a
  plain C loop over the same panels in a build without AVX2. `kernels.linear_isa` names
  the path (logged when the kernels load); benchmarks/linear_bf16.py measures it against
  oneDNN and torch (docs/benchmarks.md).
- "onednn" (PackedLinear): oneDNN's blocked layout from
  `torch.ops.mkldnn._reorder_linear_weight` (the route vLLM-CPU and IPEX take).

In float32, results differ from MKL's only by summation order (fp32 rounding).

    linear_backend   CPU fp32                       CPU bf16                otherwise
    "auto"           cpu with a vector GEMM (AVX2   cpu with a vector       torch
                     or above), else onednn, else   GEMM, else torch
                     torch
    "cpu"            cpu (its portable loop in a build without AVX2:    ValueError
                     CONVEYOR_CPU_ISA=portable, aarch64; ValueError
                     without the C kernels)
    "onednn"         onednn                         ValueError              ValueError
    "torch"          nn.Linear                      nn.Linear (bf16)        nn.Linear

With "cpu" in bfloat16 the weights are held in bf16 and everything else runs in float32
(ModelRunner): the activations, the norms, attention and the KV cache; with vdpbf16ps the
GEMM rounds its input rows to bf16 for the products (sums stay float32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from conveyor.config.engine import LINEAR_BACKENDS
from conveyor.model.cpu import cpu_kernels
from conveyor.model.cpu.huge_pages import arena_empty
from conveyor.validation import check_choice

# The row count oneDNN's reorder tunes the blocked layout for; any row count works with it.
_BATCH_HINT = 16


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend `name` means on `device` / `dtype`: "torch", "onednn" or "cpu".

    Raises:
        ValueError: an unknown name, or "onednn" / "cpu" where it cannot run.
    """
    check_choice("linear_backend", name, LINEAR_BACKENDS)
    cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    ours = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    onednn = cpu_fp32 and torch.backends.mkldnn.is_available()
    if name == "auto":
        kernels = cpu_kernels.load() if ours else None
        if kernels is not None and kernels.linear_vectorized:
            return "cpu"
        return "onednn" if onednn else "torch"
    got = f"got device {device.type} and dtype {str(dtype).removeprefix('torch.')}"
    if name == "onednn" and not onednn:
        raise ValueError(
            "linear_backend 'onednn' runs on CPU in float32 only (with oneDNN available); "
            f"{got}. Use 'auto' or 'torch'."
        )
    if name == "cpu" and not ours:
        raise ValueError(f"linear_backend 'cpu' runs on CPU in float32 or bfloat16; {got}.")
    if name == "cpu":
        _c_kernels()
    return name


def _c_kernels() -> Any:
    """The loaded C kernels.

    Raises:
        ValueError: they cannot be built here (no C compiler, or the build failed).
    """
    kernels = cpu_kernels.load()
    if kernels is None:
        raise ValueError(
            "linear_backend 'cpu' needs the C kernels (a C compiler); the log says why they "
            "are unavailable. Use 'auto' or 'onednn'."
        )
    return kernels


def linear_factory(
    backend: str, weight_dtype: torch.dtype = torch.float32
) -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module]:
    """What pack_linears builds for a resolved backend, "cpu" (weights in `weight_dtype`,
    float32 or bfloat16) or "onednn" (float32).

    Raises:
        ValueError: "cpu" without the C kernels.
    """
    if backend == "cpu":
        kernels = _c_kernels()
        return lambda weight, bias: CpuLinear(weight, bias, kernels, weight_dtype)
    return PackedLinear


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def group_panels(panels: torch.Tensor, split: bool = False) -> torch.Tensor:
    """[P, L, ...] panels (L 64-byte lines each) -> [P * L, ...] in groups of
    LINEAR_PANEL_GROUP panels stored line by line: each group's line 0 of every panel, then
    line 1, ... (the last group holds the panels left over), as csrc/gemm_panels.h reads them.
    `split` (bf16 panels on a vdpbf16ps build): with an odd number of whole groups the middle
    one is stored as two groups of half as many panels (csrc/gemm_panels.h's split_group: two
    threads' shares of a decode step each one stream)."""
    group = cpu_kernels.LINEAR_PANEL_GROUP
    whole = panels.shape[0] // group
    line = panels.shape[2:]

    def by_lines(blocks: torch.Tensor) -> torch.Tensor:  # [G, g, L, ...]: each group in turn
        return blocks.transpose(1, 2).reshape(-1, *line)

    groups = panels[: whole * group].unflatten(0, (-1, group))
    if split and whole % 2:
        mid = whole // 2
        halves = groups[mid].unflatten(0, (2, group // 2))
        parts = [by_lines(groups[:mid]), by_lines(halves), by_lines(groups[mid + 1 :])]
    else:
        parts = [by_lines(groups)]
    tail = panels[whole * group :].transpose(0, 1).reshape(-1, *line)
    return torch.cat([*parts, tail])


class CpuLinear(nn.Module):
    """y = x @ W.T + b through csrc/gemm.c, W held in 16-column panels (inference only).

    `weight_dtype` float32 keeps W exactly, a panel's line one k's 16 weights; bfloat16 holds
    it in half the bytes (rounded to nearest), a line one pair of k's 16 pairs ([16, 2]: k in
    pairs, the operand vdpbf16ps takes; gemm_panels.h). The panels are stored in groups of four,
    line by line (group_panels; in bf16 on vdpbf16ps, the middle of an odd number of groups
    as two pairs), so a decode step's thread reads its share as one stream. x, b and y are
    float32 either way; where the build has AVX512-BF16 (`kernels.linear_isa`
    "avx512-bf16") the kernel rounds x to bf16 for the products.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: Any,
        weight_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if weight_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"CpuLinear holds float32 or bfloat16 weights, not {weight_dtype}.")
        n, k = weight.shape
        panel = cpu_kernels.LINEAR_PANEL
        with torch.no_grad():
            if weight_dtype == torch.float32:
                padded = weight.new_zeros(-(-n // panel) * panel, k, dtype=torch.float32)
                padded[:n] = weight.detach()
                # [panels, 16, K] -> [panels, K, 16]: each k's 16 weights side by side
                packed = padded.view(-1, panel, k).transpose(1, 2)
            else:
                # k in pairs (an odd K padded with a zero): [panels, 16, K / 2, 2] ->
                # [panels, K / 2, 16, 2], column j's k = 2i and 2i + 1 in one 32-bit word
                kp = k + k % 2
                padded = weight.new_zeros(-(-n // panel) * panel, kp, dtype=weight_dtype)
                padded[:n, :k] = weight.detach()
                packed = padded.view(-1, panel, kp // 2, 2).transpose(1, 2)
            # bf16 on vdpbf16ps: the middle of an odd number of groups stored as two halves
            split = weight_dtype == torch.bfloat16 and kernels.linear_isa == "avx512-bf16"
            packed = group_panels(packed, split)
            placed = arena_empty(packed.shape, packed.dtype)  # huge pages while loading
            placed.copy_(packed)
        self.register_buffer("packed_weight", placed, persistent=False)
        b = None if bias is None else bias.detach().float().contiguous()
        self.register_buffer("bias", b, persistent=False)
        self.in_features, self.out_features = k, n
        self.kernels = kernels

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64, any shape) of W as float32 [*ids.shape, K], read from the panels
        in one C call: an embedding lookup in the head's weights, for a model whose head is its
        embedding matrix (tied).

        Raises:
            ValueError: an id outside [0, out_features).
        """
        n, k = self.out_features, self.in_features
        return self.kernels.linear_rows(self.packed_weight, n, k, ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"CpuLinear takes float32 [..., {self.in_features}], got {x.dtype} "
                f"{tuple(x.shape)}."
            )
        rows = x.reshape(-1, self.in_features)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        out = self.kernels.linear(rows, self.packed_weight, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


class HeadEmbedding(nn.Module):
    """A tied model's token embedding read from its packed head (CpuLinear.weight_rows), so
    the matrix is held once, in the head's panels; rows come back float32."""

    def __init__(self, head: CpuLinear) -> None:
        super().__init__()
        self._rows = head.weight_rows  # a bound method, not a submodule: the head is lm_head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._rows(ids)


class Float32Embedding(nn.Embedding):
    """An embedding table held in a narrower dtype (bfloat16) whose rows come back float32,
    for a model that computes in float32."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).float()


def pack_linears(
    model: nn.Module,
    make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module] = PackedLinear,
) -> int:
    """Replace every nn.Linear under `model` by `make(weight, bias)` (a PackedLinear, or
    linear_factory's CpuLinear); a model whose logits reuse the embedding matrix (tied,
    `lm_head` None) gets a packed copy of it as its `lm_head`, and when that is a CpuLinear
    the embedding lookup reads the head's panels (HeadEmbedding: one copy of the matrix; a
    PackedLinear's layout is oneDNN's, so its embedding keeps the plain matrix). An untied
    embedding held in another dtype than float32 is wrapped to return float32 rows.

    Returns:
        How many were replaced or added.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, make(child.weight, child.bias))
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if type(embed) is not nn.Embedding:
        return len(targets)
    if getattr(model, "lm_head", False) is None:
        model.lm_head = make(embed.weight, None)
        if isinstance(model.lm_head, CpuLinear):
            inner.embed_tokens = HeadEmbedding(model.lm_head)
        return len(targets) + 1
    if embed.weight.dtype != torch.float32:
        inner.embed_tokens = Float32Embedding.from_pretrained(embed.weight, freeze=True)
    return len(targets)

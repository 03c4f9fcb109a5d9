"""CPU GEMMs with each weight packed once, at load: our C kernel or oneDNN.

`nn.Linear` on CPU calls MKL's sgemm, which re-blocks the weight on every call; at the row
counts of a decode step (one row per running sequence) that costs more than the
multiplication. Both packed backends lay the weight out once:

- "cpu" (CpuLinear): panels of 16 output columns for csrc/linear.c's AVX2 kernel, which
  streams each weight once per step and keeps 6 x 16 outputs in registers (a build without
  AVX2 has a plain C loop over the same panels instead). At decode sizes
  it is 1.4-2x oneDNN on our 2-core box (every linear of SmolLM2-135M's shape, 16 rows:
  48 vs 68 ms; 1 row: 15 vs 32), and about even at prefill sizes.
- "onednn" (PackedLinear): oneDNN's blocked layout from
  `torch.ops.mkldnn._reorder_linear_weight` (the route vLLM-CPU and IPEX take).

Results differ from MKL's only by summation order (fp32 rounding).

    linear_backend   CPU fp32                                  otherwise
    "auto"           cpu with the AVX2 GEMM, else onednn,      torch
                     else torch
    "cpu"            cpu (its portable loop in a build without  ValueError (CPU fp32 only)
                     AVX2: CONVEYOR_CPU_ISA=portable, aarch64;
                     ValueError without the C kernels)
    "onednn"         onednn                                    ValueError (CPU fp32 only)
    "torch"          nn.Linear                                 nn.Linear
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from conveyor.engine.config import LINEAR_BACKENDS
from conveyor.model import cpu_kernels
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
    onednn = cpu_fp32 and torch.backends.mkldnn.is_available()
    if name == "auto":
        kernels = cpu_kernels.load() if cpu_fp32 else None
        if kernels is not None and kernels.linear_vectorized:
            return "cpu"
        return "onednn" if onednn else "torch"
    got = f"got device {device.type} and dtype {str(dtype).removeprefix('torch.')}"
    if name == "onednn" and not onednn:
        raise ValueError(
            "linear_backend 'onednn' runs on CPU in float32 only (with oneDNN available); "
            f"{got}. Use 'auto' or 'torch'."
        )
    if name == "cpu" and not cpu_fp32:
        raise ValueError(f"linear_backend 'cpu' runs on CPU in float32 only; {got}.")
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


def linear_factory(backend: str) -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module]:
    """What pack_linears builds for a resolved backend, "cpu" or "onednn".

    Raises:
        ValueError: "cpu" without the C kernels.
    """
    if backend == "cpu":
        kernels = _c_kernels()
        return lambda weight, bias: CpuLinear(weight, bias, kernels)
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


class CpuLinear(nn.Module):
    """y = x @ W.T + b through csrc/linear.c, W held in 16-column panels (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: Any) -> None:
        super().__init__()
        n, k = weight.shape
        panel = cpu_kernels.LINEAR_PANEL
        with torch.no_grad():
            padded = weight.new_zeros(-(-n // panel) * panel, k, dtype=torch.float32)
            padded[:n] = weight.detach()
            # [panels, 16, K] -> [panels, K, 16]: each k's 16 weights side by side
            packed = padded.view(-1, panel, k).transpose(1, 2).contiguous()
        self.register_buffer("packed_weight", packed, persistent=False)
        b = None if bias is None else bias.detach().float().contiguous()
        self.register_buffer("bias", b, persistent=False)
        self.in_features, self.out_features = k, n
        self.kernels = kernels

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


def pack_linears(
    model: nn.Module,
    make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module] = PackedLinear,
) -> int:
    """Replace every nn.Linear under `model` by `make(weight, bias)` (a PackedLinear, or
    linear_factory's CpuLinear); a model whose logits reuse the embedding matrix (tied,
    `lm_head` None) gets a packed copy of it as its `lm_head` (the embedding lookup keeps the
    plain matrix).

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
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if getattr(model, "lm_head", False) is None and isinstance(embed, nn.Embedding):
        model.lm_head = make(embed.weight, None)
        return len(targets) + 1
    return len(targets)

"""CPU GEMMs through oneDNN with each weight reordered once, at load ("prepacked").

`nn.Linear` on CPU calls MKL's sgemm, which re-blocks the weight on every call; at the row
counts of a decode step (one row per running sequence) that costs more than the
multiplication. oneDNN's linear takes the weight in its own blocked layout, made once by
`torch.ops.mkldnn._reorder_linear_weight` (the route vLLM-CPU and IPEX take). Measured on our
2-core Zen 3 box, fp32, a 768 x 2048 weight: see benchmarks/throughput.py and the README.
Results differ from MKL's only by summation order (fp32 rounding).

    linear_backend   CPU fp32            otherwise
    "auto"           onednn              torch
    "onednn"         onednn              ValueError (CPU fp32 only)
    "torch"          nn.Linear           nn.Linear
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.engine.config import LINEAR_BACKENDS
from conveyor.validation import check_choice

# The row count oneDNN's reorder tunes the blocked layout for; any row count works with it.
_BATCH_HINT = 16


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend `name` means on `device` / `dtype`: "torch" or "onednn".

    Raises:
        ValueError: an unknown name, or "onednn" where it cannot run.
    """
    check_choice("linear_backend", name, LINEAR_BACKENDS)
    usable = device.type == "cpu" and dtype == torch.float32
    usable = usable and torch.backends.mkldnn.is_available()
    if name == "auto":
        return "onednn" if usable else "torch"
    if name == "onednn" and not usable:
        raise ValueError(
            "linear_backend 'onednn' runs on CPU in float32 only (with oneDNN available); "
            f"got device {device.type} and dtype {str(dtype).removeprefix('torch.')}. "
            "Use 'auto' or 'torch'."
        )
    return name


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


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear under `model` by a PackedLinear of the same weight; a model
    whose logits reuse the embedding matrix (tied, `lm_head` None) gets a packed copy of it
    as its `lm_head` (the embedding lookup keeps the plain matrix).

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
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if getattr(model, "lm_head", False) is None and isinstance(embed, nn.Embedding):
        model.lm_head = PackedLinear(embed.weight, None)
        return len(targets) + 1
    return len(targets)

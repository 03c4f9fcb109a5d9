"""A MoEBlock's experts described to csrc/moe.c: one C call runs a step's chosen experts
(their linears are the fused decoder layers' team kernels): the module loop of models/moe.py,
bit for bit for GGUF blocks. Used for steps of fewer rows than any expert's GEMM threshold (a
QuantLinear switches to its dequantized GEMM from GEMM_ROWS rows, which moe.c does not run);
longer steps keep the module loop."""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from conveyor.model.cpu.fused_layers import describe_linear
from conveyor.model.cpu.kernel_structs import LinearDescC, MoeArgsC
from conveyor.model.cpu.quant_linear import QuantLinear, q8a_bytes

_ERRORS = {1: "a quantized type the kernel does not handle", 4: "an expert id out of range"}


class MoeKernel:
    """Callable as `kernel(x, weights, chosen)` -> the experts' weighted sum [T, H], or None
    where the step is too long for it (see the module docstring)."""

    def __init__(self, kernels: Any, experts: Any, passes: int, max_rows: float) -> None:
        first = experts[0]
        self._fn = kernels.fns["moe_f32"]
        self.hidden = first.gate_up_proj.in_features
        self.inter = first.down_proj.in_features
        self.passes, self.max_rows = passes, max_rows
        self._gate_up = (LinearDescC * len(experts))(
            *(describe_linear(e.gate_up_proj) for e in experts)
        )
        self._down = (LinearDescC * len(experts))(*(describe_linear(e.down_proj) for e in experts))
        self.num_experts = len(experts)
        # Work buffers kept between calls (a step's size), grown when a step needs more.
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._xq = torch.empty(0, dtype=torch.uint8)

    @classmethod
    def build(cls, experts: Any, kernels: Any) -> MoeKernel | None:
        """The kernel for `experts` (a ModuleList of GatedMLPs on our CPU linears, bias-free
        and of one activation passes), or None where csrc/moe.c cannot run them."""
        if kernels is None or "moe_f32" not in kernels.fns or not len(experts):
            return None
        linears = [m for e in experts for m in (e.gate_up_proj, e.down_proj)]
        if any(describe_linear(m) is None or getattr(m, "bias", None) is not None
               for m in linears):  # fmt: skip
            return None
        quantized = [m for m in linears if isinstance(m, QuantLinear)]
        if len({m.passes for m in quantized}) > 1:
            return None
        gemm = [m.gemm_rows for m in quantized if m.gemm_rows is not None]
        passes = quantized[0].passes if quantized else 2
        return cls(kernels, experts, passes, min(gemm, default=math.inf))

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor | None:
        t = x.shape[0]
        if t >= self.max_rows or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        x = x.contiguous()
        chosen = chosen.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        h, inter = self.hidden, self.inter
        out = torch.zeros(t, h, dtype=torch.float32)
        scratch = self._scratch = _at_least(self._scratch, t * (2 * h + 3 * inter))
        xg, gate_up, act, y, _ = scratch.split(
            [t * h, t * 2 * inter, t * inter, t * h, scratch.numel() - t * (2 * h + 3 * inter)]
        )
        xq = self._xq = _at_least(self._xq, q8a_bytes(self.passes, max(t, 1), max(h, inter)))
        args = MoeArgsC(
            t=t, hidden=h, inter=inter, top_k=chosen.shape[1], num_experts=self.num_experts,
            passes=self.passes, num_threads=torch.get_num_threads(), x=x.data_ptr(),
            out=out.data_ptr(), topk_ids=chosen.data_ptr(), topk_weights=weights.data_ptr(),
            gate_up=ctypes.addressof(self._gate_up), down=ctypes.addressof(self._down),
            xg=xg.data_ptr(), gate_up_out=gate_up.data_ptr(), act=act.data_ptr(),
            y=y.data_ptr(), xq=xq.data_ptr(),
        )  # fmt: skip
        failed = self._fn(ctypes.byref(args))
        if failed == 3:
            raise MemoryError("the experts' kernel could not allocate its pairs.")
        if failed:
            raise ValueError(f"the experts' kernel failed: {_ERRORS.get(failed, failed)}.")
        return out


def _at_least(buffer: torch.Tensor, n: int) -> torch.Tensor:
    """`buffer`, or a new one of `n` elements (its dtype) where it holds fewer."""
    return buffer if buffer.numel() >= n else torch.empty(n, dtype=buffer.dtype)

"""The decoder's small element-wise steps, one launch each on CUDA: RMSNorm with the residual
add fused in, the rotary embedding in place, and SiLU(gate) * up.

In plain torch a bf16 RMSNorm is about nine kernels (add, upcast, square, mean, rsqrt, ...),
the rotary embedding seven and the MLP's activation two. A small model's decode step is made
of such kernels: replayed from a CUDA graph, its time at batch 1 is mostly the fixed cost of
~36 kernels per layer, not its weight reads. These kernels cut that to ~10 per layer
(docs/benchmarks.md#decoding-end-to-end-cuda-graphs-and-fused-kernels).

The arithmetic follows the torch modules (models/layers.py), which follow transformers, in
fp32 with the same roundings to the model's dtype: the sum x + residual is rounded before it is
normalised, the normalised row is rounded before it is scaled by the weight, SiLU(gate) is
rounded before the product. Only the order of the mean's sum differs. The rotary embedding
rounds once per output instead of after each product (more accurate than torch's bf16 ops).

They are the `kernels` object of models/layers.py's RMSNorm, RotaryEmbedding and GatedMLP on
CUDA (loading/loader.py), in the interface of the CPU's C kernels (cpu/cpu_kernels.py):
`accepts`, `rms_norm`, `add_rms_norm_`, `rotary_step`, `silu_mul`. Under TRITON_INTERPRET=1
they run on CPU tensors for tests (fp32 only: the interpreter's bf16 arithmetic is wrong).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton import knobs

from conveyor.kernels._checks import check

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, out_ptr, w_ptr, s_x, s_res, s_out, hidden, eps,
    HAS_RES: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row: (optionally res = x + res, stored) out = rms_norm(res or x) * w."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    x = tl.load(x_ptr + row * s_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * s_res + offs, mask=ok, other=0.0).to(tl.float32)
        total = (x + r).to(res_ptr.dtype.element_ty)  # rounded as torch's add
        tl.store(res_ptr + row * s_res + offs, total, mask=ok)
        x = total.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / hidden
    y = x * tl.rsqrt(mean_sq + eps)
    if ROUND:  # transformers: normalise in fp32, cast, then scale in the model's dtype
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_out + offs, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cs_ptr, s_xt, s_xh, s_cs, num_heads,
    HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """One token, every head, in place: [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin]."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    cos = tl.load(cs_ptr + pos * s_cs + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    ok = (offs_h[:, None] < num_heads) & d_ok[None, :]
    p1 = x_ptr + t * s_xt + offs_h[:, None] * s_xh + offs_d[None, :]
    x1 = tl.load(p1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(p1 + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty),
             mask=ok)  # fmt: skip


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, s_gu, s_out, width,
    ROUND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One block of one row: out = silu(gate) * up, gate_up = [gate | up]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    g = tl.load(gu_ptr + row * s_gu + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * s_gu + width + offs, mask=ok, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    if ROUND:  # torch: silu's result in the model's dtype, then the product
        s = s.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * s_out + offs, (s * u).to(out_ptr.dtype.element_ty), mask=ok)


def accepts(x: torch.Tensor) -> bool:
    """Whether these kernels take `x` (the layers ask before each call): fp16/bf16/fp32 on
    CUDA; fp32 under the interpreter."""
    if x.is_cuda:
        return x.dtype in _FLOATS
    return x.dtype == torch.float32 and bool(knobs.runtime.interpret)


def _norm_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    check(x.dim() == 2 and x.stride(1) == 1, "x must be [N, H] with contiguous rows.")
    check(x.dtype in _FLOATS, f"x must be fp16, bf16 or fp32, got {x.dtype}.")
    check(
        tuple(weight.shape) == (x.shape[1],) and weight.is_contiguous(),
        f"weight must be contiguous [{x.shape[1]}], got {tuple(weight.shape)}.",
    )
    check(weight.device == x.device, f"weight is on {weight.device}, x on {x.device}.")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight for the rows of x [N, H], as a new tensor."""
    _check_rows(x, weight)
    rows, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x, x, out, weight, x.stride(0), 0, out.stride(0), hidden, eps,
            HAS_RES=False, ROUND=x.dtype != torch.float32, BLOCK=block,
            num_warps=_norm_warps(block),
        )  # fmt: skip
    return out


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight (rows of [N, H])."""
    _check_rows(x, weight)
    check(
        residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype,
        "residual must be x's shape and dtype with contiguous rows.",
    )
    rows, hidden = x.shape
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x, residual, x, weight, x.stride(0), residual.stride(0), x.stride(0), hidden, eps,
            HAS_RES=True, ROUND=x.dtype != torch.float32, BLOCK=block,
            num_warps=_norm_warps(block),
        )  # fmt: skip


def rotary_step(positions: torch.Tensor, cos_sin: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A function that rotates x [T, H, D] in place (heads contiguous, any token stride) by the
    rows `positions` (int64 [T]) of cos_sin [max_position, D] ([cos | sin] halves). Positions
    are not read on the host (that would wait for the GPU): the runner keeps them below
    max_model_len, which is at most the table's length."""
    check(positions.dtype == torch.int64 and positions.dim() == 1, "positions must be int64 [T].")
    check(cos_sin.dim() == 2 and cos_sin.stride(1) == 1, "cos_sin must be [max_position, D].")
    check(cos_sin.device == positions.device, "positions and cos_sin on different devices.")
    t, d = positions.numel(), cos_sin.shape[1]

    def rotate(x: torch.Tensor) -> None:
        check(x.dim() == 3 and x.shape[0] == t and x.shape[2] == d, f"x must be [{t}, H, {d}].")
        check(x.stride(2) == 1 and x.stride(1) == d, "x needs contiguous heads.")
        check(x.device == positions.device, f"x is on {x.device}, positions on the other.")
        if t:
            _rotary_kernel[(t,)](
                x, positions, cos_sin, x.stride(0), x.stride(1), cos_sin.stride(0), x.shape[1],
                HALF=d // 2, HEADS_PAD=triton.next_power_of_2(x.shape[1]),
                HALF_PAD=triton.next_power_of_2(d // 2),
            )  # fmt: skip

    return rotate


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up = [gate | up] ([N, 2 I]) as a new [N, I] tensor."""
    check(gate_up.dim() == 2 and gate_up.stride(1) == 1, "gate_up must be [N, 2I].")
    check(gate_up.shape[1] % 2 == 0, f"gate_up's width must be even, got {gate_up.shape[1]}.")
    check(gate_up.dtype in _FLOATS, f"gate_up must be fp16, bf16 or fp32, got {gate_up.dtype}.")
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    if rows and width:
        block = min(1024, triton.next_power_of_2(width))
        _silu_mul_kernel[(rows, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), width,
            ROUND=gate_up.dtype != torch.float32, BLOCK=block,
        )  # fmt: skip
    return out

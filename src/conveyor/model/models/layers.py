"""Building blocks shared by the decoder families: RMSNorm, rotary embedding, gated MLP.

Each block matches transformers' arithmetic (same op order, fp32 where transformers uses fp32)
so that float32 logits agree to ~1e-5 with `AutoModelForCausalLM`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (the vLLM calling convention).

    `norm(x)` returns the normalised x. `norm(x, residual)` first forms `x + residual` and
    returns `(normalised sum, sum)`: the sum is the residual stream the next block adds to.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # The CPU's C kernels (cpu/cpu_kernels.py) or CUDA's Triton ones (conveyor.kernels.fused)
        # once use_kernels() put the model on them; each call asks `kernels.accepts(x)`.
        self.kernels: Any = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel; identical to the formula below in fp32.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # transformers normalises in fp32, casts back, then scales by the (low precision) weight.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With the kernels (rows of [N, H] they accept), `norm(x, residual)` works in place: the
        sum goes into `residual` and the normalised sum into `x` (both fresh activations the
        decoder does not read again)."""
        k = self.kernels
        if k is not None and x.dim() == 2 and x.stride(1) == 1 and k.accepts(x):
            if residual is None:
                return k.rms_norm(x, self.weight, self.eps)
            if residual.dtype == x.dtype and residual.stride(1) == 1:
                k.add_rms_norm_(x, residual, self.weight, self.eps)
                return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def use_kernels(model: nn.Module, kernels: Any) -> int:
    """Run `model`'s RMSNorms (residual add fused in), rotary embedding and gated-MLP
    activation through `kernels` wherever `kernels.accepts` their input (others keep torch):
    the CPU's C kernels (conveyor.model.cpu.cpu_kernels, fp32) or CUDA's Triton ones
    (conveyor.kernels.fused). Returns how many modules it switched."""
    mods = [m for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, GatedMLP))]
    for m in mods:
        m.kernels = kernels
    return len(mods)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32, on CPU) for default, linear, llama3 or yarn
    rope.

    Args:
        head_dim: rotary dimension (the whole head).
        theta: rope base.
        scaling: None / {"rope_type": "default"}, {"rope_type": "linear", "factor"} or
            {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}, or {"rope_type": "yarn", "factor",
            "original_max_position_embeddings", optional "beta_fast", "beta_slow", "truncate",
            "attention_factor", "mscale", "mscale_all_dim"}.
    Returns:
        float32 tensor, same values as transformers' rope init functions.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise ValueError(
        f"Unsupported rope_type {rope_type!r}; supported: default, linear, llama3, yarn "
        "(dynamic: dynamic_ntk_inv_freq)."
    )


def dynamic_ntk_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], max_position: int
) -> torch.Tensor:
    """Dynamic NTK rope: inverse frequencies per position, [max_position, head_dim // 2].

    The token at position p is rotated with the base transformers computes for a sequence of
    max(p + 1, original) tokens, so generated tokens and prompts within the original context
    get exactly transformers' rotations. A longer prompt's own tokens differ: transformers
    rotates them all with the whole prompt's base, which would tie a token's rotation to how
    the prompt was chunked (the server's load). vLLM's one base for factor x the context is
    not what transformers computes for short prompts. `scaling`: the config's rope_scaling.
    """
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    # float32 tensor arithmetic, as transformers computes it from its int64 sequence length.
    # Its power runs on 0-dim tensors, this vectorised one can round the last bit differently
    # (~1e-9 in a frequency, far below a float32 angle's own rounding at those positions).
    lengths = torch.arange(1, max_position + 1, dtype=torch.int64, device="cpu").clamp(min=old_len)
    base = theta * ((factor * lengths / old_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base[:, None] ** exponent[None, :])


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those that turn more than `beta_fast` times are kept,
    with a linear ramp between the two (transformers' `_compute_yarn_parameters`)."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = (
        (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by: YaRN's `attention_factor` (by default
    0.1 ln(factor) + 1, or the ratio of the mscale terms), 1 for every other rope type."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else mscale()


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed cos/sin table indexed by position.

    The table `cos_sin_cache` is [max_position, head_dim] = [cos(half) | sin(half)], computed
    once in fp32 and then cast with the module (model.to(dtype)), exactly as transformers
    casts its per-call cos/sin. Positions must be < max_position.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        freq_factors: tuple[float, ...] | None = None,
    ) -> None:
        """freq_factors: one divisor per frequency (a GGUF file's rope_freqs), or None."""
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}.")
        self.head_dim = head_dim
        self.max_position = max_position
        if scaling and scaling.get("rope_type") == "dynamic":  # one row per position
            inv_freq = dynamic_ntk_inv_freq(head_dim, theta, scaling, max_position)
        else:
            inv_freq = rope_inv_freq(head_dim, theta, scaling)[None, :]
        if freq_factors is not None:
            if len(freq_factors) != head_dim // 2:
                raise ValueError(f"{len(freq_factors)} rope factors for head size {head_dim}.")
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32, device="cpu")
        # Explicit device: stays real even when the model is built under torch.device("meta").
        pos = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        freqs = pos[:, None] * inv_freq
        scale = rope_attention_factor(scaling)
        cache = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.kernels: Any = None  # see RMSNorm.kernels

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Look up cos, sin for positions [T]; each comes back as [T, 1, head_dim // 2]."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def step(self, positions: torch.Tensor) -> RopeStep:
        """The rotation of one step's tokens (positions [T]), shared by every layer."""
        return RopeStep(self, positions)


class RopeStep:
    """Rotates [T, H, D] heads by one step's positions: in place through the kernels
    (RMSNorm.kernels) when use_kernels() enabled them and they accept x, with
    contiguous heads, else with apply_rotary (cos/sin looked up once, on first use)."""

    def __init__(self, emb: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.emb = emb
        self.positions = positions
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rotate: Any = None  # the C kernel for these positions (checked once, all layers)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k = self.emb.kernels
        if k is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2] and k.accepts(x):
            if self._rotate is None:
                self._rotate = k.rotary_step(self.positions, self.emb.cos_sin_cache)
            self._rotate(x)
            return x
        if self._cos_sin is None:
            self._cos_sin = self.emb(self.positions)
        return apply_rotary(x, *self._cos_sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, 1, D/2] (rotate_half convention of transformers)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused into one GEMM.

    gate_up_proj.weight = cat([gate_proj.weight, up_proj.weight]) (loader concatenates).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.kernels: Any = None  # see RMSNorm.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        k = self.kernels
        if k is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1 and k.accepts(gate_up):
            return self.down_proj(k.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

"""A mixture-of-experts feed-forward block: a router picks each token's top-k experts, and the
block's output is their outputs weighted by the router (transformers' Qwen2/3-MoE and
Mixtral blocks, whose weight names it keeps).

    router   probs = softmax(gate(x)) in float32; the top k per token (ties: the lower
             expert index, as torch.topk); renormalized to sum 1 when `norm_topk`
    experts  each expert is a GatedMLP; the tokens are grouped by expert (one sort), so an
             expert runs one GEMM pair over all of its tokens and an expert no token chose
             is never read
    output   sum over k of weight_k * expert_k(x), accumulated expert by expert in index
             order (transformers' order: float32 parity is exact), plus Qwen2-MoE's shared
             expert scaled by sigmoid(shared_expert_gate(x))

A subclass may route otherwise (`route`, `router_bias`) and build other experts
(`make_expert`; `fusable` False keeps them off the fused kernels): gpt-oss (models/gpt_oss.py).

Each expert's linears are ordinary modules (`experts.{e}.gate_up_proj`, `...down_proj`), so
the checkpoint's per-expert weights load, split for tensor parallelism (each expert's
intermediate dimension; the router is replicated) and pack for the CPU GEMMs as a dense
MLP's do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.models.layers import GatedMLP


class MoEBlock(nn.Module):
    """Args:
    config: the model's (this rank's) config: its expert count, top-k and sizes.
    norm_topk: renormalize the top-k weights (Mixtral always; Qwen: `norm_topk_prob`).
    weights_in_float: multiply the expert outputs by the float32 weights (Mixtral) rather
        than by the weights cast to the activations' dtype (Qwen).
    """

    router_bias: ClassVar[bool] = False
    # Whether the experts are bias-free GatedMLPs, which the fused kernels (CUDA's grouped
    # GEMMs, csrc/moe.c) run; a subclass with other experts keeps the module loop.
    fusable: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, norm_topk: bool, weights_in_float: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk, self.weights_in_float = norm_topk, weights_in_float
        self.gate = nn.Linear(hidden, self.num_experts, bias=self.router_bias)
        self.experts = nn.ModuleList(self.make_expert(config) for _ in range(self.num_experts))
        shared = config.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(hidden, shared) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared else None
        # The experts in one kernel, (x, weights, chosen) -> their weighted sum, or None for
        # a step it does not take: CUDA's grouped GEMMs over the stacked weights
        # (use_grouped_gemm), the CPU's csrc/moe.c (model/cpu/moe_kernel.py).
        self.fused: Callable[..., torch.Tensor | None] | None = None
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None

    def make_expert(self, config: ModelConfig) -> nn.Module:
        return GatedMLP(config.hidden_size, config.moe_intermediate_size)

    def use_grouped_gemm(self, fused_moe: Callable[..., torch.Tensor]) -> bool:
        """Run the experts through `fused_moe` (kernels/fused_moe.py) over their weights
        stacked [E, 2I, H] and [E, H, I]; each expert's weight becomes a view of the stack, so
        the weights are in memory once. False (nothing changed) where an expert's linears
        are not plain bias-free nn.Linear (quantized ones, say)."""
        if not self.fusable:
            return False
        linears = [m for e in self.experts for m in (e.gate_up_proj, e.down_proj)]
        if any(type(m) is not nn.Linear or m.bias is not None for m in linears):
            return False
        self.w13 = torch.stack([e.gate_up_proj.weight.detach() for e in self.experts])
        self.w2 = torch.stack([e.down_proj.weight.detach() for e in self.experts])
        for i, expert in enumerate(self.experts):
            expert.gate_up_proj.weight = nn.Parameter(self.w13[i], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(self.w2[i], requires_grad=False)
        self.fused = lambda x, weights, chosen: fused_moe(x, self.w13, self.w2, weights, chosen)
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, experts [T, k] int64)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        fused = self.fused(x, weights, chosen) if self.fused is not None else None
        if fused is not None:
            return self._add_shared(x, fused)
        if not self.weights_in_float:
            weights = weights.to(x.dtype)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        slot_weights = weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]
                y = self.experts[expert](x[rows]) * slot_weights[start : start + n, None]
                # (one add per row: an expert's rows are distinct; index_add_ costs far more
                # for the few rows of a decode step)
                out.index_put_((rows,), y.to(out.dtype), accumulate=True)
                start += n
        return self._add_shared(x, out)

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return out
        gate = torch.sigmoid(self.shared_expert_gate(x))  # type: ignore[misc]
        return out + gate * self.shared_expert(x)


def experts_on_host(model: nn.Module) -> bool:
    """Whether some MoEBlock of `model` runs its module loop, which reads each expert's token
    count on the host (no CUDA graph can hold that)."""
    return any(isinstance(m, MoEBlock) and m.fused is None for m in model.modules())


def use_grouped_gemm(model: nn.Module) -> int:
    """Put every MoEBlock of `model` (on CUDA) on kernels/fused_moe.py; returns how many."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        return 0
    from conveyor.kernels.fused_moe import fused_moe

    return sum(block.use_grouped_gemm(fused_moe) for block in blocks)


def use_cpu_kernels(model: nn.Module, kernels: object) -> int:
    """Put every MoEBlock of `model` whose experts csrc/moe.c can run on it (model/cpu/
    moe_kernel.py); returns how many."""
    from conveyor.model.cpu.moe_kernel import MoeKernel

    count = 0
    for block in model.modules():
        if isinstance(block, MoEBlock) and block.fusable:
            block.fused = MoeKernel.build(block.experts, kernels)
            count += block.fused is not None
    return count

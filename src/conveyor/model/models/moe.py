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

Each expert's linears are ordinary modules (`experts.{e}.gate_up_proj`, `...down_proj`), so
the checkpoint's per-expert weights load, split for tensor parallelism (each expert's
intermediate dimension; the router is replicated) and pack for the CPU GEMMs as a dense
MLP's do.
"""

from __future__ import annotations

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

    def __init__(self, config: ModelConfig, norm_topk: bool, weights_in_float: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk, self.weights_in_float = norm_topk, weights_in_float
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, config.moe_intermediate_size) for _ in range(self.num_experts)
        )
        shared = config.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(hidden, shared) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, experts [T, k] int64)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
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
                out.index_add_(0, rows, y.to(out.dtype))
                start += n
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))  # type: ignore[misc]
            out = out + gate * self.shared_expert(x)
        return out

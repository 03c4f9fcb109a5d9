"""OLMoE (`OlmoeForCausalLM`, AllenAI's OLMoE-1B-7B): Llama's decoder with a mixture of
experts in every layer (models/moe.py), computed as transformers' modeling_olmoe computes it:

    attention  q and k each RMS-normalized over the whole projection (all heads together,
               weights [heads * head_dim] and [kv_heads * head_dim]), then q, k and v
               clamped to +-clip_qkv when the config gives one, then rope
    router     softmax over the experts, the top k, renormalized only with norm_topk_prob
               (false by default)
    experts    SiLU-gated MLPs of `intermediate_size`, no shared expert, every layer sparse
               (transformers reads no decoder_sparse_step or mlp_only_layers for OLMoE)

The checkpoint's per-expert weights (`mlp.experts.{e}.{gate,up,down}_proj`, as transformers
saves them) and the router `mlp.gate` load as Qwen2-MoE's do. llama.cpp's `olmoe` files keep
HF's q/k rows (neox rope) and stack each layer's experts in `ffn_*_exps`; they are read as
llama.cpp runs them: the top k renormalized only where `olmoe.expert_weights_norm` says so,
and no clamp (its converter writes none, its graph applies none).

Refused in one line (check_config): a head_dim that makes the q projection narrower or wider
than hidden_size (transformers' q_norm is hidden_size wide), a sliding window (transformers'
OLMoE masks causally but would hand the window to some attention kernels), a clip_qkv that
is not a positive number, and a config with no num_experts.

Tensor parallelism: each rank holds its heads' slice of q_norm and k_norm; the mean square of
the whole projection is the all-reduced sum of each rank's squares (ProjectionNorm).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from conveyor.model.attention.metadata import AttentionMetadata
from conveyor.model.kv_cache import KVCache
from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.models.layers import RMSNorm, RopeStep
from conveyor.model.models.llama import LLAMA, LLAMA_GGUF, LlamaAttention, LlamaForCausalLM
from conveyor.model.models.moe import MoEBlock


def check_olmoe_config(config: ModelConfig) -> None:
    """ValueError (one line) for an OLMoE config this module does not run as transformers."""
    width = config.num_attention_heads * config.head_dim
    if width != config.hidden_size:
        raise ValueError(
            f"OLMoE's q/k norms span hidden_size ({config.hidden_size}); head_dim "
            f"{config.head_dim} x {config.num_attention_heads} heads is {width}, which is not "
            "supported."
        )
    if config.sliding_window is not None:
        raise ValueError(
            f"OLMoE with a sliding_window ({config.sliding_window}) is not supported: "
            "transformers' OLMoE attends to the whole context."
        )
    clip = config.clip_qkv
    if clip is not None and not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"OLMoE's clip_qkv must be a positive number or null, got {clip}.")
    if config.num_experts == 0:
        raise ValueError("OLMoE's config gives no num_experts; it is required.")


class ProjectionNorm(RMSNorm):
    """RMSNorm over a whole q or k projection [T, heads * head_dim]. Under tensor parallelism
    (`tp` set) every rank holds an equal slice of the projection (a KV head that several ranks
    replicate counts once per rank), so the mean square is the all-reduced sum of squares over
    size times the local width."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.tp: Any = None  # a TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.tp is None:
            return super().forward(x)  # type: ignore[return-value]
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        self.tp.all_reduce(squares)
        xf = xf * torch.rsqrt(squares / (x.shape[-1] * self.tp.size) + self.eps)
        return self.weight * xf.to(x.dtype)


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.q_norm = ProjectionNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = ProjectionNorm(self.kv_size, config.rms_norm_eps)
        self.clip = config.clip_qkv

    def forward(
        self, x: torch.Tensor, rope: RopeStep, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        shape = (x.shape[0], -1, self.head_dim)
        q, k = rope(q.reshape(shape)), rope(k.reshape(shape))
        out = self.backend.forward(q, k, v.view(shape), kv_cache, meta, self.scale, self.window)
        return self.o_proj(out)


class OlmoeForCausalLM(LlamaForCausalLM):
    SPEC = dataclasses.replace(
        LLAMA,
        architectures=("OlmoeForCausalLM",),
        # The experts' size is config.json's intermediate_size (there is no dense MLP).
        config_names={"moe_intermediate_size": "intermediate_size"},
        # The q/k norm weights follow their projection's rows.
        tp_splits={**LLAMA.tp_splits, "q_norm": "heads", "k_norm": "kv_heads"},
        gguf=dataclasses.replace(LLAMA_GGUF, architecture="olmoe", permuted_qk=False),
        # transformers' OlmoeConfig defaults where they are not ModelConfig's (a config
        # without num_experts is refused: its default would hide num_local_experts).
        config_defaults={
            "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "num_experts_per_tok": 8,
        },
        check_config=check_olmoe_config,
    )  # fmt: skip
    attention_class = OlmoeAttention

    def __init__(
        self, config: ModelConfig, backend: Any = None, tp: Any = None, shard: Any = None
    ) -> None:
        super().__init__(config, backend, tp=tp, shard=shard)
        if shard is not None:
            for layer in self.model.layers:
                layer.self_attn.q_norm.tp = layer.self_attn.k_norm.tp = tp

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module | None:
        # Every layer, and never a shared expert: transformers' OLMoE reads neither key.
        moe = dataclasses.replace(config, shared_expert_intermediate_size=0)
        return MoEBlock(moe, norm_topk=config.norm_topk_prob, weights_in_float=False)

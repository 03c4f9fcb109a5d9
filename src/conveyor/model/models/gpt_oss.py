"""gpt-oss (`GptOssForCausalLM`) from bfloat16 or float32 safetensors, and from the MXFP4 ones
it is released as (loading/mxfp4.py: the experts kept in their 4-bit blocks on our C kernels,
else dequantized at load). Llama's decoder, with these differences, each computed as
transformers computes it:

    attention  q/k/v/o biases, sliding-window and full layers alternating (`layer_types`),
               YaRN rope, and a learned sink logit per query head (`self_attn.sinks`) that
               joins the softmax's denominator only (the backend's `sinks`)
    router     `mlp.router` (our `mlp.gate`, with a bias): the top k of its logits, then a
               softmax over those k
    experts    every layer a mixture (models/moe.py); each expert's linears have biases and
               the clamped SwiGLU (up + 1) * gate * sigmoid(alpha * gate)
    weights    the checkpoint stacks each layer's experts, gate and up interleaved
               (`gate_up_proj` [E, H, 2I], gate = [..., ::2]) and transposed from
               nn.Linear's [out, in]; `split_stacked_experts` makes each expert's
               gate_proj, up_proj and down_proj of them at load, which then fuse, split for
               tensor parallelism and pack as any MoE's do; an MXFP4 checkpoint's stacks
               kept quantized (QuantExperts, [E, out, in] with gate and up interleaved by
               rows) become each expert's QuantLinears the same way

The experts keep MoEBlock's module loop, on float or MXFP4 linears: neither CUDA's grouped
GEMMs nor csrc/moe.c run biases or this activation (`fusable`). The fused C decoder layers
refuse the model (its attention and MLP are not the plain Llama ones), so
csrc/decoder_layers.c never sees sinks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conveyor.model.attention.metadata import AttentionMetadata
from conveyor.model.cpu.quant_linear import QuantExperts
from conveyor.model.kv_cache import KVCache
from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.models.layers import RopeStep
from conveyor.model.models.llama import LLAMA, LlamaAttention, LlamaForCausalLM
from conveyor.model.models.moe import MoEBlock
from conveyor.model.models.spec import FamilySpec


class GptOssAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))

    def forward(
        self, x: torch.Tensor, rope: RopeStep, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        hq, hkv = self.num_heads, self.num_kv_heads
        heads = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)  # [T, Hq + 2 Hkv, D]
        q, k = rope(heads[:, : hq + hkv]).split([hq, hkv], 1)
        out = self.backend.forward(
            q, k, heads[:, hq + hkv :], kv_cache, meta, self.scale, self.window, self.sinks
        )
        return self.o_proj(out)


class GptOssExpert(nn.Module):
    """One expert: gate_up_proj = [gate; up] (de-interleaved at load), biases, and the
    clamped SwiGLU."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=True)
        self.down_proj = nn.Linear(inter, hidden, bias=True)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GptOssMoE(MoEBlock):
    router_bias = True
    fusable = False  # biases and the clamped SwiGLU: the module loop

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, norm_topk=False, weights_in_float=False)

    def make_expert(self, config: ModelConfig) -> nn.Module:
        return GptOssExpert(
            config.hidden_size,
            config.moe_intermediate_size,
            config.swiglu_alpha,
            config.swiglu_limit,
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top k logits (ties: the lower index, as transformers), softmaxed over k."""
        logits, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)
        return torch.softmax(logits, dim=-1, dtype=torch.float32), chosen


_STACKS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def split_stacked_experts(
    name: str, tensor: torch.Tensor | QuantExperts
) -> list[tuple[str, Any]] | None:
    """Each expert's weights of a stacked checkpoint tensor `...mlp.experts.<stack>` as
    views, named as per-expert checkpoints name them; None for any other tensor. An MXFP4
    checkpoint's weight stacks kept quantized (QuantExperts, loading/mxfp4.py) are in
    nn.Linear's orientation already, gate and up interleaved by rows."""
    prefix, _, stack = name.rpartition(".")
    if not prefix.endswith("mlp.experts") or stack not in _STACKS:
        return None
    if isinstance(tensor, QuantExperts):
        if stack not in ("gate_up_proj", "down_proj"):
            raise ValueError(f"{name} is quantized, but only the experts' weights can be.")
        return _split_quantized(prefix, stack, tensor)
    out = []
    for e, t in enumerate(tensor.unbind(0)):
        base = f"{prefix}.{e}"
        if stack == "gate_up_proj":  # [H, 2I] -> [I, H] each
            out += [
                (f"{base}.gate_proj.weight", t[:, ::2].T),
                (f"{base}.up_proj.weight", t[:, 1::2].T),
            ]
        elif stack == "gate_up_proj_bias":
            out += [(f"{base}.gate_proj.bias", t[::2]), (f"{base}.up_proj.bias", t[1::2])]
        elif stack == "down_proj":  # [I, H] -> [H, I]
            out.append((f"{base}.down_proj.weight", t.T))
        else:
            out.append((f"{base}.down_proj.bias", t))
    return out


def _split_quantized(prefix: str, stack: str, experts: QuantExperts) -> list[tuple[str, Any]]:
    out = []
    for e in range(experts.shape[0]):
        base = f"{prefix}.{e}"
        if stack == "gate_up_proj":  # rows: gate, up, gate, up, ...
            out += [
                (f"{base}.gate_proj.weight", experts.expert(e, slice(0, None, 2))),
                (f"{base}.up_proj.weight", experts.expert(e, slice(1, None, 2))),
            ]
        else:
            out.append((f"{base}.down_proj.weight", experts.expert(e)))
    return out


class GptOssForCausalLM(LlamaForCausalLM):
    SPEC = FamilySpec(
        architectures=("GptOssForCausalLM",),
        packed_modules=LLAMA.packed_modules,  # q/k/v and each expert's gate/up
        tp_splits={**LLAMA.tp_splits, "sinks": "heads"},  # the router is replicated
        config_names={"moe_intermediate_size": "intermediate_size"},
        renames={"router": "gate"},
        unstack=split_stacked_experts,
    )
    attention_class = GptOssAttention
    attention_sinks = True

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module | None:
        return GptOssMoE(config)

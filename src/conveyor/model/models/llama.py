"""Llama-family decoders: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

Module names mirror transformers' (`model.layers.N.self_attn...`) except two fused GEMMs:
`qkv_proj` = cat(q_proj, k_proj, v_proj) and `mlp.gate_up_proj` = cat(gate_proj, up_proj).
Residual adds are fused into the following RMSNorm, so a layer passes (hidden, residual) along.
Each class's `SPEC` (models/spec.py) declares what the loader, the tensor-parallel split and
the GGUF reader need: its config.json names, the fused weights, each weight's split, and its
GGUF tensor names.

Sliding-window attention: `ModelConfig.layer_windows` gives each layer's window (None: full
attention), as transformers decides it (Mistral's `sliding_window` on every layer, Qwen2/3's
`use_sliding_window` from layer `max_window_layers` on, or a per-layer `layer_types` list). A
layer with window W lets the token at position p see keys p - W + 1 .. p (W keys, itself
included), which every attention backend applies; requests may run past the window.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.attention.metadata import AttentionBackend, AttentionMetadata
from conveyor.model.attention.registry import get_attention_backend
from conveyor.model.distributed.sharding import VocabParallelEmbedding
from conveyor.model.kv_cache import KVCache
from conveyor.model.loading.model_config import ModelConfig  # also imported from here by callers
from conveyor.model.models.layers import GatedMLP, RMSNorm, RopeStep, RotaryEmbedding
from conveyor.model.models.spec import FamilySpec, GGUFNames

# llama.cpp's tensor names (the same for its llama, qwen2 and qwen3 files).
LLAMA_GGUF = GGUFNames(
    architecture="llama",
    layer_names={
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "ffn_gate_inp": "mlp.gate",  # Mixtral's router (its files are `llama` ones)
    },
    global_names={
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    },
    permuted_qk=True,
    bias_from_tensors=True,
    experts="mlp.experts.{e}",  # Mixtral's blk.N.ffn_*_exps
)

LLAMA = FamilySpec(
    # The bare decoder (no head): embedding checkpoints saved from AutoModel.
    architectures=("LlamaForCausalLM", "LlamaModel"),
    packed_modules={
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    },
    tp_splits={
        "q_proj": "heads",
        "k_proj": "kv_heads",
        "v_proj": "kv_heads",
        "o_proj": "row",
        "gate_proj": "column",
        "up_proj": "column",
        "down_proj": "row",
        "embed_tokens": "vocab",
        "lm_head": "vocab",
    },  # the norms (Qwen3's q/k norms included) are replicated
    gguf=LLAMA_GGUF,
)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        backend: AttentionBackend,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.window = window  # sliding window (None: the whole context)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.scale = d**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeStep,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hq, hkv = self.num_heads, self.num_kv_heads
        heads = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)  # [T, Hq + 2 Hkv, D]
        v = heads[:, hq + hkv :]
        if self.q_norm is None:
            # One rotary call for q and k heads together (they share cos/sin per token).
            q, k = rope(heads[:, : hq + hkv]).split([hq, hkv], 1)
        else:
            q, k, _ = heads.split([hq, hkv, hkv], 1)
            q, k = rope(self.q_norm(q)), rope(self.k_norm(k))
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.window))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, attn: LlamaAttention, mlp: nn.Module | None = None
    ) -> None:
        """mlp: the feed-forward block (a mixture of experts, say); None: a GatedMLP."""
        super().__init__()
        self.self_attn = attn
        self.tp: Any = None  # a TPGroup: the attention and MLP outputs are partial sums
        if mlp is None:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeStep,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        if self.tp is not None:
            x = self.tp.all_reduce(x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.tp is not None:
            x = self.tp.all_reduce(x)
        return x, residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, make_attn: Any, make_mlp: Any) -> None:
        super().__init__()
        # No random init: the loader fills it (built under the meta device, whose normal_
        # would import torch._dynamo and triton: memory and start-up time for nothing).
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, make_attn(i), make_mlp(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            config.rope_freq_factors,
        )


class LlamaForCausalLM(nn.Module):
    """Llama decoder over a paged KV cache. Subclasses only change per-family flags."""

    SPEC: ClassVar[FamilySpec] = LLAMA
    force_qkv_bias: ClassVar[bool] = False  # Qwen2: q/k/v always have bias, o_proj none
    qk_norm: ClassVar[bool] = False  # Qwen3: RMSNorm per head on q and k before rope
    attention_class: ClassVar[type[LlamaAttention]] = LlamaAttention
    # Learned per-head logits in the softmax's denominator (gpt-oss): the backend must
    # declare supports_sinks (checked before anything loads).
    attention_sinks: ClassVar[bool] = False

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend | None = None,
        tp: Any = None,
        shard: Any = None,
    ) -> None:
        """tp, shard: a tensor-parallel rank's TPGroup and Shard (model/distributed/: its
        head, MLP and vocabulary slices); None: the whole model."""
        super().__init__()
        self.config = config
        self.tp = tp
        # fused_layers.FusedLayers once the runner has put the model on our C kernels: every
        # layer and the final norm of a qualifying step in one C call (bit for bit the loop
        # in forward).
        self.fused_layers: Any = None
        if shard is not None:  # the modules below are built with this rank's sizes
            config = shard.local_config(config)
        self.kv_config = config  # what this rank's KV cache holds (its KV heads)
        # Every layer's attention backend (one object shared by all of them).
        self.attention_backend = backend = backend or get_attention_backend("torch", "cpu")
        qkv_bias = config.attention_bias or self.force_qkv_bias
        o_bias = config.attention_bias

        windows = config.layer_windows or (None,) * config.num_hidden_layers

        def make_attn(i: int) -> LlamaAttention:
            return self.attention_class(config, qkv_bias, o_bias, self.qk_norm, backend, windows[i])

        self.model = LlamaModel(config, make_attn, self.make_mlp)
        # Tied: logits reuse the embedding matrix, so there is no lm_head parameter at all.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        if shard is not None:
            self.model.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size, tp)
            for layer in self.model.layers:
                layer.tp = tp

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module | None:
        """Decoder layer `layer`'s feed-forward block (None: the dense GatedMLP); a family
        with another (models/moe.py) overrides this."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run one flat varlen batch.

        Args:
            input_ids: int64 [T] new tokens of every request, batch order.
            positions: int64 [T] their positions (< max_position_embeddings).
            kv_caches: one cache per layer (see conveyor.model.kv_cache; written).
            meta: the step's AttentionMetadata.
        Returns:
            final-norm hidden states [T, hidden_size].
        """
        m = self.model
        x, residual = m.embed_tokens(input_ids), None
        fused = self.fused_layers
        hidden = None if fused is None else fused(x, positions, kv_caches, meta)
        if hidden is not None:  # every layer and the final norm in one C call
            return hidden
        rope = m.rotary_emb.step(positions)  # once per step, shared by all layers
        for layer, kv_cache in zip(m.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        x, _ = m.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, H] -> float32 logits [N, vocab]. Tensor-parallel: every rank calls it,
        rank 0 gets the gathered logits and the others None."""
        if self.lm_head is None:  # tied (until linear.pack_linears gives it a packed head)
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if self.tp is not None:
            return self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits


class MistralForCausalLM(LlamaForCausalLM):
    """Same graph as Llama (its sliding window: see the module docstring). llama.cpp writes
    Mistral GGUF files as `llama` ones."""

    SPEC = dataclasses.replace(
        LLAMA, architectures=("MistralForCausalLM", "MistralModel"), gguf=None
    )


class Qwen2ForCausalLM(LlamaForCausalLM):
    # Rows in HF's order; q/k/v always have a bias (force_qkv_bias), o_proj none.
    SPEC = dataclasses.replace(
        LLAMA,
        architectures=("Qwen2ForCausalLM", "Qwen2Model"),
        gguf=dataclasses.replace(
            LLAMA_GGUF, architecture="qwen2", permuted_qk=False, bias_from_tensors=False
        ),
    )
    force_qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    SPEC = dataclasses.replace(
        LLAMA,
        architectures=("Qwen3ForCausalLM", "Qwen3Model"),
        gguf=dataclasses.replace(
            LLAMA_GGUF, architecture="qwen3", permuted_qk=False, bias_from_tensors=False
        ),
    )
    qk_norm = True

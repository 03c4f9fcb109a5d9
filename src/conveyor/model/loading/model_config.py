"""The fields of an HF config.json the decoders use (`ModelConfig.from_hf_config`), and which
layers use a sliding window (`layer_windows`). Pure Python: no torch import."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ModelConfig:
    """The fields of an HF config.json our decoders use (built by `from_hf_config`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None = default rope; else has "rope_type"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # GGUF rope_freqs (Llama 3.1+ files): each rotary frequency is divided by its factor.
    rope_freq_factors: tuple[float, ...] | None = None
    sliding_window: int | None = None  # the window of the layers that use one
    # One entry per layer: its sliding window, or None for full attention (empty: all full).
    layer_windows: tuple[int | None, ...] = ()
    # Mixture of experts (models/moe.py; 0 experts: every layer's MLP is dense). A layer i
    # is sparse unless i is in mlp_only_layers or (i + 1) is no multiple of
    # decoder_sparse_step, as transformers' Qwen2/3-MoE decide.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    # gpt-oss's experts: (up + 1) * gate * sigmoid(alpha * gate), gate and up clamped to limit.
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] after the q/k norms (None: no clamp).
    clip_qkv: float | None = None

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s MLP is a mixture of experts."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], names: Mapping[str, str] | None = None
    ) -> ModelConfig:
        """Build from a config.json dict (transformers 4 or 5 rope fields).

        transformers 5 writes `rope_parameters` {rope_type, rope_theta, factor, ...};
        transformers 4 writes `rope_theta` plus an optional `rope_scaling` dict ("type" or
        "rope_type"). Both are accepted.

        Args:
            names: the family's config names (FamilySpec.config_names): field -> the key its
                config.json uses for it, read when present (a GGUF file's config dict uses
                the fields' own names).
        """
        if names:
            hf = {**hf, **{ours: hf[theirs] for ours, theirs in names.items() if theirs in hf}}
        archs = hf.get("architectures") or []
        windows = layer_windows(hf)
        if not archs:
            raise ValueError("config.json has no 'architectures' entry.")
        quant = hf.get("quantization_config")
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if quant is not None and str(method).lower() != "mxfp4":
            # MXFP4 experts are read by loading/mxfp4.py; other formats' tensors are not
            raise ValueError(
                f"quantization_config quant_method {method!r} is not supported; conveyor loads "
                "bfloat16, float16 and float32 checkpoints, MXFP4 ones (gpt-oss) and GGUF files."
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Only hidden_act 'silu' is supported, got {hf['hidden_act']!r}.")
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of {kv_heads}.")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        if "full_attention" in rope:  # transformers 5 per-layer-type form
            rope = dict(rope["full_attention"])
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in ("default", "linear", "llama3", "yarn", "dynamic"):
            raise ValueError(
                f"Unsupported rope type {rope_type!r}; supported: default, linear, llama3, yarn, "
                "dynamic."
            )
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **rope}
        max_position = hf.get("max_position_embeddings", 2048)
        if rope_type == "dynamic":
            # As transformers: max_position_embeddings is the original context; the context
            # served is factor times that (vLLM's rule). See layers.dynamic_ntk_inv_freq.
            scaling["original_max_position_embeddings"] = max_position
            max_position = max(max_position, int(max_position * scaling["factor"]))
        if rope_type in ("llama3", "yarn"):  # as transformers standardizes them
            if "original_max_position_embeddings" in hf:
                scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
            scaling.setdefault(
                "original_max_position_embeddings", hf.get("max_position_embeddings", 2048)
            )
            if scaling.get("factor") is None:
                scaling["factor"] = (
                    hf.get("max_position_embeddings", 2048)
                    / scaling["original_max_position_embeddings"]
                )
        return cls(
            architecture=archs[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=max_position,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_freq_factors=tuple(hf["rope_freq_factors"]) if "rope_freq_factors" in hf else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=next((w for w in windows if w is not None), None),
            layer_windows=windows,
            swiglu_alpha=float(hf.get("swiglu_alpha") or 1.702),
            swiglu_limit=float(hf.get("swiglu_limit") or 7.0),
            clip_qkv=None if hf.get("clip_qkv") is None else float(hf["clip_qkv"]),
            **_experts(hf),
        )


def _experts(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a config.json dict (none: dense)."""
    # (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts, Mixtral's name.)
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if not experts:
        return {}
    top_k = int(hf["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok must be 1 .. num_experts ({experts}); got {top_k}.")
    step = int(hf.get("decoder_sparse_step") or 1)
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be at least 1; got {step}.")
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(hf["moe_intermediate_size"]),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": step,
        "mlp_only_layers": tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0),
    }


def layer_windows(hf: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers picks them.

    transformers 5 lists `layer_types` ("sliding_attention" / "full_attention"); older Qwen2/3
    configs gate the window behind `use_sliding_window`, from layer `max_window_layers` on;
    otherwise (Mistral) a `sliding_window` applies to every layer.

    Raises:
        ValueError: a `layer_types` list of the wrong length or with another attention type.
    """
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window") or None
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != n or not set(layer_types) <= {"full_attention", "sliding_attention"}:
            raise ValueError(
                f"config.json's layer_types {layer_types!r} must list 'full_attention' or "
                f"'sliding_attention' for each of the {n} layers."
            )
        if "use_sliding_window" in hf and not hf["use_sliding_window"]:
            window = None  # Qwen2/3: transformers drops the window when it is switched off
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if "use_sliding_window" in hf:
        first = hf.get("max_window_layers", 0) if hf["use_sliding_window"] else n
        return tuple(window if i >= first else None for i in range(n))
    return (window,) * n

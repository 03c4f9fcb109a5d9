"""Tiny GGUF files written from the random HF checkpoints of tests/hf_checkpoints.py.

`write_gguf` lays a checkpoint out as llama.cpp's converter does (its tensor names, its
metadata keys, `llama` q/k rows in GGML's interleaved rope order, the byte-level BPE
vocabulary as `gpt2` tokens and merges, the chat template), so that both transformers' GGUF
loader and conveyor's read the same bytes.

A checkpoint with llama3 rope gets the `rope_freqs.weight` tensor llama.cpp's converter writes
for Llama 3.1+ (one divisor per rotary frequency; the file keeps the original rope base).

Quantization: `gguf.quants.quantize` writes F16, BF16, Q8_0, Q4_0 and Q4_1. It cannot write the
K-quants (Q4_K, Q6_K: dequantize only), so for those each 256-value block is filled with random
bytes and a small float16 super-block scale: valid blocks whose dequantized values are the
weights both loaders see. Norms and biases stay F32, as llama.cpp keeps them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file

_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
         "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama",
         "olmoe": "olmoe"}  # fmt: skip
LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
# An expert's linear (HF leaf) -> llama.cpp's 3-D tensor of all experts' [E, rows, cols].
_EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "down_proj": "ffn_down_exps", "w1": "ffn_gate_exps", "w3": "ffn_up_exps",
                 "w2": "ffn_down_exps"}  # fmt: skip
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Random-byte K-quant blocks: (bytes per 256 values, offset of the float16 scale(s), scale).
_K_QUANTS = {
    QType.Q4_K: (144, (0, 2), 2e-4),
    QType.Q5_K: (176, (0, 2), 1e-4),
    QType.Q6_K: (210, (208,), 3e-5),
}


def gguf_name(hf_name: str) -> str:
    parts = hf_name.split(".")
    leaf = parts[-1]
    if parts[-2] in _EXPERT_PARTS and parts[3] == "experts":  # a stacked name of _stack_experts
        return f"blk.{parts[2]}.{_EXPERT_PARTS[parts[-2]]}.{leaf}"
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{LAYER_PARTS['.'.join(parts[3:-1])]}.{leaf}"
    return f"{_GLOBAL['.'.join(parts[:-1])]}.{leaf}"


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's per-expert weights `...experts.{e}.{leaf}.weight` as one [E, rows, cols]
    tensor named `...experts.{leaf}.weight` (llama.cpp's ffn_*_exps)."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, value in tensors.items():
        parts = name.split(".")
        if len(parts) == 8 and parts[4] == "experts":  # model.layers.N.X.experts.E.leaf.weight
            key = ".".join(["model", "layers", parts[2], "experts", parts[6], parts[7]])
            stacks.setdefault(key, {})[int(parts[5])] = value
        else:
            out[name] = value
    for key, by_expert in stacks.items():
        out[key] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def _permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """HF's half-split rotary rows -> GGML's interleaved order (llama.cpp's converter)."""
    half = w.shape[0] // num_heads // 2
    grouped = w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(grouped).reshape(w.shape)


def _random_k_blocks(rows: int, cols: int, qtype: QType, rng: np.random.Generator) -> np.ndarray:
    block_bytes, scale_offsets, scale = _K_QUANTS[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        d = np.full((rows, cols // 256), scale, np.float16)
        blocks[:, :, offset : offset + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def write_gguf(
    checkpoint: Path,
    out: Path,
    qtype: QType,
    embed_qtype: QType | None = None,
    seed: int = 0,
    metadata: dict[str, tuple[Any, gguf.GGUFValueType]] | None = None,
    drop: tuple[str, ...] = (),
    edit: Callable[[str, np.ndarray], np.ndarray | tuple[np.ndarray, QType]] | None = None,
) -> Path:
    """Write `checkpoint` (an HF folder of tests/hf_checkpoints.py) as the GGUF file `out`.

    Args:
        qtype: the type of every 2-D weight (F32 for none).
        embed_qtype: token_embd's type when it differs (llama.cpp often keeps it at Q8_0/Q6_K).
        metadata: {key: (value, value type)} written instead of (or besides) what the
            checkpoint gives, e.g. a hostile `llama.block_count` (`{arch}` in a key is the
            file's architecture).
        drop: metadata keys left out (e.g. "tokenizer.ggml.merges").
        edit: (GGUF name, float32 values) -> the values to write instead, in the file's type,
            or (raw array, type) written as they are (bytes labelled as that type, say).
    """
    cfg = json.loads((checkpoint / "config.json").read_text())
    arch = _ARCH[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{cfg['model_type']}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, checkpoint)
    tensors = _stack_experts(load_file(str(checkpoint / "model.safetensors")))
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(
            cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        )
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    rng = np.random.default_rng(seed)
    for name, value in sorted(tensors.items()):
        value = value.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = _permute_rows(value, heads if "q_proj" in name else kv_heads)
        t = embed_qtype if (embed_qtype is not None and "embed_tokens" in name) else qtype
        edited = value if edit is None else edit(gguf_name(name), value)
        if isinstance(edited, tuple):
            w.add_tensor(gguf_name(name), edited[0], raw_dtype=edited[1])
            continue
        value = edited
        if value.ndim == 1 or t == QType.F32:
            w.add_tensor(gguf_name(name), value)
        elif t in _K_QUANTS:
            rows = math.prod(value.shape[:-1])
            blocks = _random_k_blocks(rows, value.shape[-1], t, rng)
            w.add_tensor(gguf_name(name), blocks.reshape(*value.shape[:-1], -1), raw_dtype=t)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(value, t), raw_dtype=t)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, head_dim))
    for key, (value, vtype) in (metadata or {}).items():
        w.kv_data[0][key.format(arch=arch)] = gguf.GGUFValue(value=value, type=vtype)
    for key in drop:
        del w.kv_data[0][key.format(arch=arch)]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Per-frequency divisors equal to llama3 rope scaling: 1 for short wavelengths, `factor`
    for long ones, the reciprocal of the blend in between (as llama.cpp's converter)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def _add_tokenizer(w: gguf.GGUFWriter, checkpoint: Path) -> None:
    """The checkpoint's byte-level BPE (tokenizer.json) as llama.cpp's `gpt2` tokenizer."""
    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    tok_cfg = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    # 1: normal, 3: control (llama.cpp's token types).
    w.add_token_types([3 if t in special else 1 for t in tokens])
    eos = tok_cfg.get("eos_token")
    eos = eos["content"] if isinstance(eos, dict) else eos
    w.add_eos_token_id(vocab[eos])
    w.add_bos_token_id(vocab[eos])
    w.add_add_bos_token(False)
    template_file = checkpoint / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else None
    template = template or tok_cfg.get("chat_template")
    if template:
        w.add_chat_template(template)

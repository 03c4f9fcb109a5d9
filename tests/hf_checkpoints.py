"""Tiny random-weight Hugging Face checkpoints written to disk, for parity tests.

Each checkpoint is a real HF folder (config.json, safetensors, tokenizer files) that both
transformers and conveyor load. The demo model's BPE tokenizer is reused so that the engine
can detokenize; the vocabulary is its size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

# Architecture name -> (config class, extra config fields). Sizes stay tiny so every
# transformers generate call takes milliseconds.
_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-rope": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            num_key_value_heads=1,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),
    # Mixtures of experts: layer 0 of qwen3-moe stays dense (mlp_only_layers).
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            tie_word_embeddings=True,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        dict(
            tie_word_embeddings=False,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(
            tie_word_embeddings=False,
            sliding_window=None,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
        ),
    ),
    # olmoe: q/k norms over the whole projection, softmax-then-top-k without renormalizing
    # (norm_topk_prob False, its default), every layer sparse.
    "olmoe": (
        "OlmoeConfig",
        dict(
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
        ),
    ),
    # gpt-oss: attention sinks, a window of 8 in layer 0 (layer 1 full), YaRN, the router's
    # top-k softmax, the experts' biases and clamped SwiGLU, stacked experts in the file.
    "gpt-oss": (
        "GptOssConfig",
        dict(
            tie_word_embeddings=False,
            head_dim=16,
            sliding_window=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
            ),
        ),
    ),
}


def write_checkpoint(
    path: Path,
    family: str,
    tokenizer_dir: Path,
    init_std: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Write a random-weight checkpoint of `family` with the tokenizer from `tokenizer_dir`.

    Args:
        init_std: the weights' init std; larger than HF's 0.02 so that greedy argmaxes are
            rarely near-ties and float reordering cannot flip them.
        dtype: the dtype the weights are saved in (config.json's dtype says it).
        overrides: config fields that replace the family's (e.g. hidden_size).
    """
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(
        **{**_BASE, **extra, **overrides},
        vocab_size=len(tok),
        initializer_range=init_std,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # HF inits biases to 0 and norms to 1: perturb them so that loading them is tested.
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, init_std)
            elif name.endswith("sinks"):  # gpt-oss: as large as the scores, so they count
                param.normal_(0.0, 1.0)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    model.to(dtype).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def greedy_reference(
    hf: transformers.PreTrainedModel,
    prompts: list[list[int]],
    max_tokens: list[int],
    with_scores: bool = False,
    ignore_eos: bool = False,
) -> list[Any]:
    """transformers' greedy tokens for each prompt alone, with an explicit attention mask
    (without one, generate masks every token equal to pad_token_id).

    with_scores: each entry is (tokens, [fp32 logits of each step]) for `agree_until_a_near_tie`.
    ignore_eos: always make max_tokens tokens (min_new_tokens), as SamplingParams(ignore_eos).
    """
    expected: list[Any] = []
    with torch.no_grad():
        for ids, m in zip(prompts, max_tokens, strict=True):
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=m,
                min_new_tokens=m if ignore_eos else None,
                do_sample=False,
                output_scores=with_scores,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            expected.append((tokens, [s[0].float() for s in out.scores]) if with_scores else tokens)
    return expected


def agree_until_a_near_tie(
    got: list[int], tokens: list[int], scores: list[torch.Tensor], tol: float
) -> int:
    """How many tokens `got` shares with transformers' `tokens`: they must be equal up to the
    first step where they differ, and there transformers' own logits of the two tokens must
    be within `tol` (a near-tie that rounding may flip; the two continue differently from
    there and are not compared further). Asserts; returns the number compared."""
    for k, (a, b) in enumerate(zip(got, tokens, strict=False)):
        if a != b:
            gap = (scores[k][b] - scores[k][a]).abs().item()
            assert gap < tol, f"step {k}: {a} vs transformers' {b}, logit gap {gap:.4f}"
            return k
    assert len(got) == len(tokens)
    return len(got)


def bf16_reference(
    path: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    ignore_eos: bool = False,
    **load: Any,
) -> list[Any]:
    """transformers' greedy runs of the checkpoint at `path` in bfloat16, as RequestOutputs
    whose logprobs hold each step's top-5 ids (for check_logprobs_close). `load`: more
    from_pretrained arguments (an MXFP4 checkpoint's quantization_config)."""
    from conveyor.engine.outputs import CompletionOutput, RequestOutput

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **load)
    refs = greedy_reference(hf, prompts, max_tokens, with_scores=True, ignore_eos=ignore_eos)
    outs = []
    for i, (tokens, scores) in enumerate(refs):
        top5 = [{int(t): None for t in s.topk(5).indices} for s in scores]
        done = CompletionOutput(0, "", tokens, logprobs=top5)
        outs.append(RequestOutput(str(i), None, prompts[i], [done], True))
    return outs


def write_chain_model(tok: Any, chain: list[int], path: Path) -> Path:
    """A tiny Llama checkpoint (with `tok`) at `path` whose greedy successor of each token of
    `chain` is the next one: the residual stream stays the token's embedding, a one-hot row k
    for chain[k], and the head gives chain[k + 1] logit 8 (sqrt(64)), every other 0."""
    import itertools

    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, vocab_size=len(tok),
        tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        embed = model.model.embed_tokens.weight
        for k, (token, successor) in enumerate(itertools.pairwise(chain)):
            embed[token].zero_()
            embed[token, k] = 1.0
            model.lm_head.weight[successor, k] = 1.0
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# The E2M1 value of each 4-bit code, as MXFP4 stores them (loading/mxfp4.py).
_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
                     -4.0, -6.0])  # fmt: skip
# openai/gpt-oss-20b's quantization_config (config.json).
MXFP4_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
    ],
    "quant_method": "mxfp4",
}  # fmt: skip


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., cols] (cols a multiple of 32) in HF's MXFP4 layout: uint8 blocks [..., cols / 32,
    16] (weight 2i of a group in byte i's low nibble, 2i + 1 in its high one) and E8M0 scales
    [..., cols / 32]: the smallest power of two that puts the group's largest |w| within 6,
    each weight the nearest E2M1 value of w / scale."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exponent), exponent.int()).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - _FP4).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def write_mxfp4_checkpoint(
    path: Path, tokenizer_dir: Path, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    """A random gpt-oss checkpoint (write_checkpoint's) as the released ones are: each layer's
    expert stacks `mlp.experts.{gate_up_proj,down_proj}` replaced by their MXFP4 `_blocks` and
    `_scales` (mxfp4_quantize, in nn.Linear's [E, out, in] orientation) and config.json's
    quantization_config; every other tensor in `dtype`. transformers reads it with
    Mxfp4Config(dequantize=True)."""
    from safetensors.torch import load_file, save_file

    write_checkpoint(path, "gpt-oss", tokenizer_dir, dtype=dtype, **overrides)
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stack = tensors.pop(name).float().transpose(1, 2)  # [E, in, out] -> [E, out, in]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = mxfp4_quantize(stack)
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path

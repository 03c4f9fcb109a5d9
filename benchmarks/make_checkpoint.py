"""A random-weight HF checkpoint at a known model's shape, for speed comparisons with peers
that load HF folders (vllm serve) when the real weights cannot be downloaded here.

The tokenizer is copied from --tokenizer-from (an HF folder, e.g. SmolLM2's written by
benchmarks/gguf_to_hf.py), so the vocabulary matches; the weights are drawn small (std 0.02)
and saved in --dtype. Speed does not depend on the values.

    python benchmarks/make_checkpoint.py --shape tinyllama --tokenizer-from /tmp/smollm2-hf \\
        /tmp/tinyllama-shape-hf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

# hidden, layers, attention heads, KV heads, intermediate (the GGUF shapes of make_gguf.py).
SHAPES = {
    "tinyllama": dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128),  # the smoke test's
    # Qwen3-30B-A3B's width with 8 of its 48 layers, its vocabulary (~11 GB in bfloat16)
    "qwen3moe-a3b-8l": dict(hidden=2048, layers=8, heads=32, kv_heads=4, ffn=6144,
                            head_dim=128, experts=128, used=8, expert_ffn=768, vocab=151936),
}  # fmt: skip


def make(shape: str, tokenizer_from: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Write the checkpoint to `out`; returns `out`."""
    s = SHAPES[shape]
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_from))
    common = dict(
        vocab_size=s.get("vocab", len(tok)),
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        intermediate_size=s["ffn"],
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        initializer_range=0.02,
    )
    if "experts" in s:
        config = transformers.Qwen3MoeConfig(
            **common, head_dim=s["head_dim"], num_experts=s["experts"],
            num_experts_per_tok=s["used"], moe_intermediate_size=s["expert_ffn"],
            norm_topk_prob=True, tie_word_embeddings=False,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True)
    torch.manual_seed(0)
    # Built in its dtype: a float32 copy first would be twice the size (44 GB for the A3B).
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama")
    p.add_argument("--tokenizer-from", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args(argv)
    print(make(args.shape, args.tokenizer_from, args.out, args.dtype))


if __name__ == "__main__":
    main()

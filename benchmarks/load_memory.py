"""Peak RSS while loading a safetensors checkpoint, against the size of the loaded weights.

Writes a random Llama checkpoint (config.json + safetensors shards, no tokenizer needed), then
loads it with `conveyor.model.loading.loader.load_model` in a fresh process per case and reads the
process's peak RSS (VmHWM, reset after the imports through /proc/self/clear_refs) minus its
RSS before the load. The target is a peak within 1.3x of the weights: the file is memory-
mapped, a tensor used as is stays a view of it, a converted or fused one releases its pages.

    python benchmarks/load_memory.py                       # ~400 MB fp32, 3 shards
    python benchmarks/load_memory.py --layers 2 --out r.json

Prints (and with --out writes) one JSON object: the checkpoint's shape and, per case
(file dtype -> load dtype): weights_mib, peak_rss_delta_mib (during load_model), ratio (peak /
weights), rss_after_load_mib, rss_after_reading_every_weight_mib (a weight kept as a view of
the file is paged in when first read, e.g. by the first forward) and load_s. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

_CHILD = r"""
import json, sys, time
import torch
from conveyor.model.loading.loader import load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

path, warmup, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
# One load of a tiny checkpoint first: the lazy imports, torch's thread pools and the code
# pages of the conversion kernels are then in RSS before the baseline, not counted as load.
load_model(warmup, dtype, "cpu")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
before = status("VmRSS:")
start = time.perf_counter()
model = load_model(path, dtype, "cpu")
seconds = time.perf_counter() - start
weights = sum(p.numel() * p.element_size() for p in model.parameters())
peak, end = status("VmHWM:") - before, status("VmRSS:") - before
# Weights used as is are views of the file, paged in on first use: read each one once.
for p in model.parameters():
    p.detach().view(torch.uint8).max()  # reads every byte, allocates nothing large
touched = status("VmRSS:") - before
print(json.dumps({"weights": weights, "peak": peak, "end": end, "touched": touched,
                  "seconds": seconds}))
"""


_TINY = dict(hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, vocab=256, shards=1)


def write_checkpoint(path: Path, args: argparse.Namespace, dtype: torch.dtype) -> None:
    h, f, v, kv = args.hidden, args.intermediate, args.vocab, args.kv_heads
    d = h // args.heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": f, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": kv, "vocab_size": v,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for i in range(args.layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }  # fmt: skip
    names = list(shapes)
    per_shard = -(-len(names) // args.shards)
    weight_map = {}
    for s in range(args.shards):
        file = f"model-{s + 1:05d}-of-{args.shards:05d}.safetensors"
        part = {
            n: torch.randn(shapes[n]).mul_(0.02).to(dtype)
            for n in names[s * per_shard :][:per_shard]
        }
        save_file(part, str(path / file))
        weight_map |= dict.fromkeys(part, file)
        del part
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def measure(path: Path, warmup: Path, load_dtype: str) -> dict[str, float]:
    src = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's conveyor
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(warmup), load_dtype],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "weights_mib": round(r["weights"] / 2**20, 1),
        "peak_rss_delta_mib": round(r["peak"] / 2**20, 1),
        "ratio": round(r["peak"] / r["weights"], 3),
        "rss_after_load_mib": round(r["end"] / 2**20, 1),
        "rss_after_reading_every_weight_mib": round(r["touched"] / 2**20, 1),
        "load_s": round(r["seconds"], 2),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cases = [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")]
    result: dict = {"checkpoint": {k: v for k, v in vars(args).items() if k != "out"}}
    with tempfile.TemporaryDirectory() as tmp:
        for file_dtype in dict.fromkeys(c[0] for c in cases):
            folder, warmup = Path(tmp) / file_dtype, Path(tmp) / f"{file_dtype}-tiny"
            folder.mkdir()
            warmup.mkdir()
            write_checkpoint(folder, args, getattr(torch, file_dtype))
            tiny = argparse.Namespace(**{**vars(args), **_TINY})
            write_checkpoint(warmup, tiny, getattr(torch, file_dtype))
            for fd, load_dtype in cases:
                if fd == file_dtype:
                    result[f"{fd}->{load_dtype}"] = measure(folder, warmup, load_dtype)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

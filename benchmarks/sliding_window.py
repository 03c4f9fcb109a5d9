"""Sliding-window attention cost: one decode step of a batch at a long context, full attention
against a window, through a conveyor attention backend (the layer call the model makes:
KV write + attention).

With a window W the C decode kernel ("cpu") and the Triton kernel read only each request's
last W keys, so a step costs about W / context of full attention's; the torch reference masks
the keys before the window but still gathers the whole context (it is the ground truth, not
the fast path). Each case also reports the largest difference from a dense masked softmax.

    python benchmarks/sliding_window.py                          # cpu backend (the default)
    python benchmarks/sliding_window.py --backend torch --batch 4 --context 2048
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from conveyor.model.attention.metadata import build_attention_metadata
from conveyor.model.attention.registry import get_attention_backend


def _case(args: argparse.Namespace, window: int | None, device: torch.device) -> dict:
    bs, hq, hkv, d = args.block_size, args.q_heads, args.kv_heads, args.head_size
    per_req = -(-args.context // bs)
    ids = list(range(1, args.batch * per_req + 1))
    random.Random(0).shuffle(ids)  # scattered blocks, as after a while of serving
    tables = [ids[i * per_req : (i + 1) * per_req] for i in range(args.batch)]
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, len(ids) + 1, bs, hkv, d, generator=gen).to(device)
    meta = build_attention_metadata(
        [1] * args.batch, [args.context] * args.batch, tables, bs, device
    )
    q = torch.randn(args.batch, hq, d, generator=gen).to(device)
    k, v = torch.randn(2, args.batch, hkv, d, generator=gen).to(device)
    backend = get_attention_backend(args.backend, device)
    scale = d**-0.5

    def step() -> torch.Tensor:
        meta.backend_state = None  # a fresh step: the plan is derived again, as in serving
        return backend.forward(q, k, v, cache, meta, scale, window)

    out = step()
    start = time.perf_counter()
    for _ in range(args.repeats):
        step()
    ms = (time.perf_counter() - start) / args.repeats * 1e3
    # Dense reference for the first request: its last `window` keys (or all of them).
    first = 0 if window is None else max(0, args.context - window)
    table = torch.tensor(tables[0], device=device)
    keys = cache[:, table].reshape(2, -1, hkv, d)[:, first : args.context]
    kk, vv = (x.transpose(0, 1).repeat_interleave(hq // hkv, 0) for x in keys)  # [Hq, L, D]
    want = ((q[0][:, None] @ kk.transpose(1, 2)) * scale).softmax(-1) @ vv
    err = (out[0].view(hq, d) - want[:, 0]).abs().max().item()
    return {"window": window, "step_ms": round(ms, 3), "max_abs_diff_vs_dense": err}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="cpu", choices=["cpu", "torch", "triton"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--windows", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.backend == "triton" else "cpu")
    with torch.inference_mode():
        cases = [_case(args, w, device) for w in [None, *args.windows]]
    full = cases[0]["step_ms"]
    for c in cases[1:]:
        c["speedup_vs_full"] = round(full / c["step_ms"], 2)
    report = {
        "backend": args.backend,
        "batch": args.batch,
        "context": args.context,
        "heads": [args.q_heads, args.kv_heads, args.head_size],
        "threads": torch.get_num_threads(),
        "cases": cases,
    }
    text = json.dumps(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()

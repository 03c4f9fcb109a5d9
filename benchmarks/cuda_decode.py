"""Decode on a CUDA GPU end to end: output tok/s at several stream counts, eager steps against
CUDA graphs, and where a decode step's time goes.

A random-weight bf16 checkpoint at a real model's shape (--shape, default Qwen2.5-0.5B's) is
written once, with a word-level tokenizer over the whole vocabulary so that every sampled id
detokenizes. The engines (--sides) share the GPU: `eager` (enforce_eager=True: every step
eager), `graphs` (the default: decode steps replay CUDA graphs, model/decode_graphs.py) and
`graphs-unfused` (graphs captured over the torch norms, rotary and activation instead of
conveyor.kernels.fused: what the fused kernels save). For each stream count S,
S requests of --prompt-len fresh random token ids (a new draw every repeat and every side, so
the prefix cache never hits) each generate --output-len tokens (ignore_eos) in one
LLM.generate; the sides alternate, --repeats times, and each side's best repeat counts.

Per side and S:
  output_tok_s      all output tokens / the generate call's wall time (prefill included)
  decode_step_ms    mean wall time of the steps in which every request decoded
  and the split of such a step:
    forward_ms      the GPU timeline of the model's forward (CUDA events before and after it;
                    gaps where the GPU waited for the host's launches count)
    launch_ms       host time spent enqueueing that forward
    host_ms         decode_step_ms - forward_ms: scheduling, metadata, sampling and its wait
                    for the tokens, detokenizing, outputs
  graph_replay_ms   (graphs side) one replay of the captured graph alone: the forward's GPU
                    floor at that batch size
Prints one JSON object (also written to --out).

    python benchmarks/cuda_decode.py --streams 1 16 64 256
    python benchmarks/cuda_decode.py --shape tiny --device cpu --streams 1 2 --output-len 4
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conveyor import LLM, SamplingParams

# hidden, layers, heads, KV heads, intermediate, vocabulary, context, rope theta, tied.
SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936, ctx=32768,
        theta=1e6, tied=True,
    ),
    "llama-3.2-1b": dict(
        hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, ctx=131072,
        theta=5e5, tied=True,
    ),
    "tiny": dict(
        hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=1024, ctx=2048, theta=1e4,
        tied=True,
    ),
}  # fmt: skip


def write_checkpoint(shape: str, out: Path, device: str) -> Path:
    """A Qwen2-architecture checkpoint of `shape` in bf16, random weights (std 0.02), with a
    word-level tokenizer of the full vocabulary."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    s = SHAPES[shape]
    vocab = {f"t{i}": i for i in range(s["vocab"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0")
    config = transformers.Qwen2Config(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        intermediate_size=s["ffn"],
        max_position_embeddings=s["ctx"],
        rope_theta=s["theta"],
        tie_word_embeddings=s["tied"],
        eos_token_id=0,
        bos_token_id=None,
        initializer_range=0.02,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out))
    fast.save_pretrained(str(out))
    return out


SIDES = ("eager", "graphs", "graphs-unfused")


def make_llm(side: str, model: Path, args) -> LLM:
    llm = LLM(
        str(model),
        device=args.device,
        dtype="bfloat16",
        max_num_seqs=max(args.streams),
        max_model_len=args.max_model_len,
        kv_cache_space_gb=args.kv_cache_space_gb,
        enforce_eager=side != "graphs",
    )
    if side == "graphs-unfused":  # the torch element-wise ops, then graphs over them
        from conveyor.model.decode_graphs import DecodeGraphs
        from conveyor.model.models.layers import use_kernels

        r = llm.llm_engine.runner
        use_kernels(r.model, None)
        r.graphs = DecodeGraphs(
            r.model, r.kv_caches, max(args.streams), r.max_model_len, r.block_size, r.device
        )
    return llm


class StepTimer:
    """Times every step of an engine: its wall time and its forward's (events, launch)."""

    def __init__(self, llm: LLM) -> None:
        engine, runner = llm.llm_engine, llm.llm_engine.runner
        self.cuda = runner.device.type == "cuda"
        self.records: list[tuple[bool, int, float, float, Any, Any]] = []
        step_fn, forward_fn = engine.step, runner.forward
        current: dict[str, Any] = {}

        def forward(step):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else None
            if ev:
                ev[0].record()
            t0 = time.perf_counter()
            out = forward_fn(step)
            current["launch"] = time.perf_counter() - t0
            if ev:
                ev[1].record()
            current["ev"] = ev
            current["batch"] = len(step.query_lens)
            current["decode"] = len(step.token_ids) == len(step.query_lens)
            return out

        def timed_step():
            current.clear()
            t0 = time.perf_counter()
            out = step_fn()
            wall = time.perf_counter() - t0
            if "batch" in current:
                ev = current["ev"] or (None, None)
                self.records.append(
                    (current["decode"], current["batch"], wall, current["launch"], *ev)
                )
            return out

        engine.step = timed_step
        runner.forward = forward

    def decode_split(self, batch: int) -> dict[str, float]:
        """Means over the decode steps of exactly `batch` requests (ms)."""
        rows = [r for r in self.records if r[0] and r[1] == batch]
        if not rows:
            return {}
        if self.cuda:
            torch.cuda.synchronize()
        step = float(np.mean([r[2] for r in rows])) * 1e3
        launch = float(np.mean([r[3] for r in rows])) * 1e3
        out = {"decode_steps": len(rows), "decode_step_ms": round(step, 4)}
        out["launch_ms"] = round(launch, 4)
        if self.cuda:
            forward = float(np.mean([r[4].elapsed_time(r[5]) for r in rows]))
            out["forward_ms"] = round(forward, 4)
            out["host_ms"] = round(step - forward, 4)
            out["host_share"] = round((step - forward) / step, 3)
        return out


def graph_replay_ms(llm: LLM, batch: int, iters: int = 50) -> float | None:
    """One replay of the graph a decode batch of `batch` uses, alone (ms)."""
    graphs = llm.llm_engine.runner.graphs
    if graphs is None:
        return None
    size = next(s for s in graphs.sizes if s >= batch)
    graph = graphs._graphs[size]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / iters, 4)


def run_once(llm: LLM, streams: int, args, seed: int) -> tuple[float, int]:
    rng = np.random.default_rng(seed)
    vocab = llm.llm_engine.runner.vocab_size
    prompts = [rng.integers(2, vocab, size=args.prompt_len).tolist() for _ in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="HF folder (default: --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-space-gb", type=float, default=8.0, help="each side's")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--sides", nargs="+", default=["eager", "graphs"], choices=list(SIDES), help="engines"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    tmp = tempfile.TemporaryDirectory()
    t0 = time.perf_counter()
    model = args.model or write_checkpoint(args.shape, Path(tmp.name) / args.shape, args.device)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "shape": None if args.model else args.shape,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "checkpoint_s": round(time.perf_counter() - t0, 2),
        "sides": {},
        "results": [],
    }
    llms: dict[str, LLM] = {}
    timers: dict[str, StepTimer] = {}
    for side in args.sides:
        t0 = time.perf_counter()
        llms[side] = make_llm(side, model, args)
        runner = llms[side].llm_engine.runner
        report["sides"][side] = {
            "start_s": round(time.perf_counter() - t0, 2),
            "graph_capture_s": None if runner.graphs is None else runner.graphs.capture_seconds,
            "attention": runner.model.attention_backend.name,
        }
        run_once(llms[side], 2, argparse.Namespace(**{**vars(args), "output_len": 4}), 10**6)
        timers[side] = StepTimer(llms[side])

    seed = 0
    for streams in args.streams:
        best: dict[str, dict[str, Any]] = {}
        every: dict[str, list[float]] = {side: [] for side in args.sides}
        for _ in range(args.repeats):
            for side in args.sides:
                timer = timers[side]
                timer.records.clear()
                seed += 1
                wall, tokens = run_once(llms[side], streams, args, seed)
                row = {"tok_s": tokens / wall, "wall_s": wall, **timer.decode_split(streams)}
                every[side].append(round(tokens / wall, 1))
                if side not in best or row["tok_s"] > best[side]["tok_s"]:
                    best[side] = row
        for side, row in best.items():
            res = {"side": side, "streams": streams, "output_tok_s": round(row.pop("tok_s"), 1)}
            res["all_tok_s"] = every[side]
            res.update({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
            if side.startswith("graphs") and args.device == "cuda":
                res["graph_replay_ms"] = graph_replay_ms(llms[side], streams)
            report["results"].append(res)
        ratios = {}
        for other in ("eager", "graphs-unfused"):
            if {"graphs", other} <= best.keys():
                ratios[f"graphs_over_{other}"] = round(max(every["graphs"]) / max(every[other]), 3)
        if ratios:
            report["results"].append({"streams": streams, **ratios})
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
    for llm in llms.values():
        llm.shutdown()
    del llms, timers
    gc.collect()
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

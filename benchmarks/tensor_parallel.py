"""Tensor parallelism on CPU: LLM.generate throughput at tensor_parallel_size 1 and 2.

One seeded workload (benchmarks/throughput.py's make_workload; greedy, ignore_eos) runs on a
random-weight Llama of --shape (default llama75m: hidden 768, 12 layers, 12 heads / 4 KV
heads, intermediate 2048, vocabulary 1000; benchmarks/side_by_side.py's shapes) or --model,
in three setups, each --repeats times, interleaved, the fastest run counting:

    tp1_1thread   tensor_parallel_size 1, one torch thread
    tp1_threads   tensor_parallel_size 1, --threads torch threads (default: every core)
    tp2           tensor_parallel_size 2, one thread per rank (two processes, gloo)

Then one more tp2 run with the collectives timed on rank 0 (TPGroup.timed): per engine step,
how many all-reduces and gathers ran and how long rank 0 spent in them (on CPU this includes
waiting for the other rank to reach the same collective), against the step's time
(ModelRunner.execute). stdout has one JSON object; progress goes to stderr.

    python benchmarks/tensor_parallel.py --shape llama75m --num-requests 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import transformers

from conveyor import LLM, SamplingParams
from conveyor.load_client.sibling import load_sibling

throughput = load_sibling(__file__, "throughput")
side_by_side = load_sibling(__file__, "side_by_side")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(side_by_side.SHAPES), default="llama75m")
    p.add_argument("--model", default=None, help="HF checkpoint folder (instead of --shape)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--mean-output", type=float, default=48.0)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if args.model:
        args.shape = None
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    with side_by_side.model_folder(args, "tp") as model:
        result = _run(args, model)
    print(json.dumps(result, indent=2))
    return result


def _run(args: argparse.Namespace, model: str) -> dict:
    vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
    prompts, out_lens = throughput.make_workload(args, vocab)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in out_lens]
    total = sum(out_lens)
    common = dict(max_num_seqs=args.batch_size, max_num_batched_tokens=2048, seed=0)
    common["kv_cache_space_gb"] = 0.25
    setups = {"tp1_1thread": (1, 1), "tp1_threads": (1, args.threads), "tp2": (2, 1)}
    engines = {}
    for name, (size, threads) in setups.items():
        torch.set_num_threads(threads)
        engines[name] = LLM(model, tensor_parallel_size=size, **common)
        warm = slice(0, args.batch_size)
        engines[name].generate(prompts[warm], params[warm], use_tqdm=False)
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(args.repeats):
        for name, (_, threads) in setups.items():
            torch.set_num_threads(threads)
            times[name].append(_timed_generate(engines[name], prompts, params, total, args))
    tp2 = engines["tp2"]
    torch.set_num_threads(1)
    comm = _collective_cost(tp2, prompts, params, total, args)
    for llm in engines.values():
        llm.llm_engine.shutdown()
    out = {
        "model": f"shape:{args.shape}" if args.shape else model,
        "shape": side_by_side.SHAPES.get(args.shape) if args.shape else None,
        "workload": {
            "requests": len(prompts),
            "batch_size": args.batch_size,
            "total_output_tokens": total,
            "prompt_tokens": sum(len(p) for p in prompts),
        },
        "cores": len(os.sched_getaffinity(0)),
    }
    for name in setups:
        best = min(times[name])
        out[name] = {
            "threads_per_rank": setups[name][1],
            "seconds": round(best, 6),
            "all_seconds": [round(t, 6) for t in times[name]],
            "output_tokens_per_s": round(total / best, 1),
        }
    out["speedup_tp2_vs_tp1_1thread"] = round(min(times["tp1_1thread"]) / min(times["tp2"]), 3)
    out["speedup_tp2_vs_tp1_threads"] = round(min(times["tp1_threads"]) / min(times["tp2"]), 3)
    out["tp2_collectives"] = comm
    return out


def _timed_generate(llm: LLM, prompts, params, total: int, args) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != total:
        raise RuntimeError(f"generated {tokens} tokens, expected {total}")
    return seconds


def _collective_cost(llm: LLM, prompts, params, total: int, args) -> dict:
    """One run with rank 0's collectives timed, and its steps counted and timed."""
    runner = llm.llm_engine.runner
    group = runner.tp
    execute = runner.execute
    steps = [0, 0.0]

    def counted(out):
        start = time.perf_counter()
        try:
            return execute(out)
        finally:
            steps[0] += 1
            steps[1] += time.perf_counter() - start

    group.timed, group.comm_seconds, group.num_collectives = True, 0.0, 0
    runner.execute = counted
    try:
        seconds = _timed_generate(llm, prompts, params, total, args)
    finally:
        runner.execute = execute
        group.timed = False
    n = max(1, steps[0])
    return {
        "seconds": round(seconds, 3),
        "steps": steps[0],
        "collectives_per_step": round(group.num_collectives / n, 2),
        "step_ms": round(1000 * steps[1] / n, 3),
        "collective_ms_per_step": round(1000 * group.comm_seconds / n, 3),
        "collective_share_of_step": round(group.comm_seconds / max(steps[1], 1e-9), 3),
    }


if __name__ == "__main__":
    main()

"""Per-step scheduler cost against the waiting-queue size, for every policy (no model).

For each policy and each queue size, that many requests (prompts 48-80 tokens, outputs
32-96, random priorities 0-3) are submitted at t = 0 to the real Scheduler, driven as the
simulator drives it (conveyor.simulator's request builder, its eos rule and its step-cost
clock), with max_num_seqs 32 and enough KV blocks for a full batch. Only the scheduler's own
calls are timed: `schedule()` and `update_from_output()`, with time.perf_counter around each.

Runs are interleaved: every repeat visits all (policy, size) pairs, in an order rotated per
repeat, and the best (lowest) median (and mean) of the repeats is kept. Prints one JSON object:

    {"steps": 200, "repeats": 3, "sizes": [100, 1000, 10000],
     "us_per_step": {"fifo": {"100": 41.2, ...}, ...},
     "mean_us_per_step": {...}, "ratio_largest_to_smallest": {"fifo": 1.02, ...}}

    python benchmarks/scheduler_cost.py                      # about a minute
    python benchmarks/scheduler_cost.py --sizes 10 20 --steps 5 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

from conveyor.config import EngineConfig
from conveyor.core.policies import available_policies
from conveyor.core.scheduler import Scheduler
from conveyor.simulator import StepCost
from conveyor.simulator.loop import _EOS, _TOKEN, _make_request
from conveyor.simulator.trace import synthetic_trace

MAX_NUM_SEQS = 32


def make_scheduler(policy: str, size: int, seed: int = 0) -> tuple[Scheduler, dict, list]:
    """A scheduler under `policy` holding `size` requests submitted at t = 0."""
    trace = synthetic_trace(
        "uniform", size, prompt_len=(48, 80), mean_output=64.0, max_output=96, seed=seed
    )
    rng = random.Random(seed)
    trace = [dataclasses.replace(r, priority=rng.randint(0, 3)) for r in trace]
    longest = max(r.prompt_len + r.max_tokens for r in trace)
    # Simulated prompts are one token repeated: a prefix cache would hit everything.
    config = EngineConfig(scheduler=policy, max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=False)
    config.max_model_len = longest
    config.num_kv_blocks = MAX_NUM_SEQS * -(-longest // config.block_size)
    clock = [0.0]
    sched = Scheduler(config, clock=lambda: clock[0])
    output_len: dict[str, int] = {}
    for i, row in enumerate(trace):
        req, tl = _make_request(row, i)
        sched.add_request(req)
        output_len[req.request_id] = tl.output_len
    return sched, output_len, clock


def time_steps(policy: str, size: int, steps: int) -> tuple[float, float]:
    """(median, mean) microseconds of schedule() + update_from_output() over `steps` steps."""
    sched, output_len, clock = make_scheduler(policy, size)
    cost = StepCost()
    perf = time.perf_counter
    samples: list[float] = []
    for _ in range(steps):
        t0 = perf()
        out = sched.schedule()
        t1 = perf()
        if out.total_num_scheduled_tokens == 0:
            break
        num_sched = out.num_scheduled_tokens
        sampled: dict[str, int] = {}
        for req in out.scheduled:  # the simulator's rule: eos at the trace length
            if req.num_computed_tokens + num_sched[req.request_id] == req.num_tokens:
                out_len = output_len[req.request_id]
                last = len(req.output_token_ids) + 1 >= out_len < req.max_tokens
                sampled[req.request_id] = _EOS if last else _TOKEN
        clock[0] += cost(out.total_num_scheduled_tokens, len(out.scheduled))
        t2 = perf()
        sched.update_from_output(out, sampled)
        t3 = perf()
        samples.append((t1 - t0) + (t3 - t2))
    if not samples:
        return 0.0, 0.0
    return statistics.median(samples) * 1e6, statistics.fmean(samples) * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=available_policies())
    parser.add_argument("--sizes", nargs="+", type=int, default=[100, 1000, 10000])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    pairs = [(p, s) for p in args.policies for s in args.sizes]
    best: dict[tuple[str, int], float] = {}
    best_mean: dict[tuple[str, int], float] = {}
    for rep in range(args.repeats):
        k = rep % len(pairs)
        for pair in pairs[k:] + pairs[:k]:  # rotated per repeat
            med, mean = time_steps(*pair, args.steps)
            best[pair] = min(med, best.get(pair, med))
            best_mean[pair] = min(mean, best_mean.get(pair, mean))
    lo, hi = min(args.sizes), max(args.sizes)
    result = {
        "steps": args.steps,
        "repeats": args.repeats,
        "sizes": args.sizes,
        "us_per_step": {
            p: {str(s): round(best[p, s], 1) for s in args.sizes} for p in args.policies
        },
        # Steps that admit are a minority; the mean shows what they cost.
        "mean_us_per_step": {
            p: {str(s): round(best_mean[p, s], 1) for s in args.sizes} for p in args.policies
        },
        "ratio_largest_to_smallest": {
            p: round(best[p, hi] / best[p, lo], 2) if best[p, lo] else None for p in args.policies
        },
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

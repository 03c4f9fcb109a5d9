"""Prefix caching: the same workloads with the cache on and off, in one run.

Two workloads, in token ids (seeded, drawn from [100, vocab - 100): no special tokens):
  multi_turn  a shared --system-tokens system prompt S and --conversations conversations of
              --turns turns. Turn k of conversation c sends S + u_1 + r_1 + ... + u_k: u_i are
              new user messages (--user-tokens MIN MAX long), r_i the model's replies to the
              turns before (greedy, ignore_eos, --output-tokens each). All conversations' turn k
              go in one LLM.generate call; the turns run one after another.
  no_shared   prompts of exactly the multi-turn prompts' lengths and the same output lengths,
              in the same --turns calls, but every prompt random: nothing for the cache to find.
Each side is an LLM(model, enable_prefix_caching=on/off) built once (the load and one warm-up
call are not timed). Every run draws fresh token ids (same lengths), so no run finds what an
earlier one left in the cache. Per run: output tokens / the summed wall time of the generate
calls (throughput), TTFT = first_token_time - arrival_time per request (p50, p99 over all
requests of all turns), and the hit rate = hits / queries of the conveyor:prefix_cache_*
counters over the run (0 with the cache off, where nothing is looked up). Runs are
interleaved (--repeats); the fastest run of each side counts.

n_samples: one --n-prompt-tokens prompt with SamplingParams(n=--n, temperature=1, seed=0,
max_tokens=16) against --n separate requests of it (seeds 0..n-1) with the cache off. Prefill
tokens computed: queries - hits with the cache on; every sequence's prompt with it off.

The model is --model DIR, --shape NAME (a random-weight Llama from side_by_side.py), or the
demo model. stdout has one JSON object; progress goes to stderr.

    python benchmarks/prefix_caching.py --shape llama75m
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from conveyor import LLM, SamplingParams
from conveyor.load_client.sibling import load_sibling

side_by_side = load_sibling(__file__, "side_by_side")

SIDES = {"caching_on": True, "caching_off": False}


def counters(llm: LLM) -> dict[str, float]:
    return {m.name.split(":")[-1]: m.value for m in llm.get_metrics() if m.kind == "counter"}


def ids(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(100, vocab - 100, size=int(n)).tolist()


def multi_turn(args, vocab: int, user_lens, rng):
    """A function turn(k, replies) -> the prompts of turn k (histories kept inside)."""
    system = ids(rng, args.system_tokens, vocab)
    users = [[ids(rng, n, vocab) for n in row] for row in user_lens]
    history = [list(system) for _ in users]

    def turn(k: int, replies):
        for c, h in enumerate(history):
            h += (replies[c] if k else []) + users[c][k]
        return [list(h) for h in history]

    return turn


def no_shared(args, vocab: int, user_lens, rng):
    """Random prompts of the multi-turn prompts' lengths: turn(k, _) -> turn k's prompts."""
    lens = args.system_tokens + np.cumsum(user_lens, axis=1)
    lens += np.arange(args.turns) * args.output_tokens  # the replies of the turns before
    prompts = [[ids(rng, lens[c, k], vocab) for c in range(len(lens))] for k in range(args.turns)]
    return lambda k, _replies: prompts[k]


def run_turns(llm: LLM, turn, turns: int, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = counters(llm)
    seconds, tokens, ttfts, replies = 0.0, 0, [], None
    for k in range(turns):
        prompts = turn(k, replies)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds += time.perf_counter() - start
        replies = [list(o.outputs[0].token_ids) for o in outs]
        tokens += sum(len(r) for r in replies)
        ttfts += [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    after = counters(llm)
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {
        "requests": len(ttfts),
        "output_tokens": tokens,
        "seconds": round(seconds, 4),
        "output_tokens_per_s": round(tokens / seconds, 1),
        "ttft_p50_s": round(float(np.percentile(ttfts, 50)), 5),
        "ttft_p99_s": round(float(np.percentile(ttfts, 99)), 5),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prefix_cache_hit_tokens": int(hits),
        "preemptions": int(after["num_preemptions"] - before["num_preemptions"]),
    }


def run_samples(llm: LLM, prompt: list[int], n: int, separate: bool, caching: bool) -> dict:
    if separate:
        prompts = [prompt] * n
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16) for i in range(n)]
    else:
        prompts, params = [prompt], SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=16)
    before = counters(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    d = {k: v - before[k] for k, v in counters(llm).items()}
    computed = d["prefix_cache_queries"] - d["prefix_cache_hits"] if caching else n * len(prompt)
    return {
        "requests": len(prompts),
        "sequences": sum(len(o.outputs) for o in outs),
        "output_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
        "seconds": round(seconds, 4),
        "prefill_tokens_computed": int(computed),
        "preemptions": int(d["num_preemptions"]),
    }


def kv_blocks_needed(args, block: int) -> int:
    """Blocks for every conversation's longest history at once (or the n samples), + 10%."""
    longest = args.system_tokens + args.turns * (args.user_tokens[1] + args.output_tokens)
    need = max(
        -(-longest // block) * args.conversations, -(-(args.n_prompt_tokens + 16) // block) * args.n
    )
    return need * 11 // 10 + 16


def best(runs: list[dict]) -> dict:
    out = dict(min(runs, key=lambda r: r["seconds"]))
    out["all_seconds"] = [r["seconds"] for r in runs]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF Llama checkpoint folder")
    src.add_argument("--shape", choices=sorted(side_by_side.SHAPES), default=None)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, nargs=2, default=[32, 96], metavar=("MIN", "MAX"))
    p.add_argument("--output-tokens", type=int, default=32, help="per turn")
    p.add_argument("--n", type=int, default=8, help="samples of one prompt (n_samples)")
    p.add_argument("--n-prompt-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: all histories fit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="runs per side; the best counts")
    args = p.parse_args(argv)
    lo, hi = args.user_tokens
    if not 1 <= lo <= hi:
        p.error("--user-tokens MIN MAX needs 1 <= MIN <= MAX")
    with side_by_side.model_folder(args, "prefix_caching") as model:
        return _run(args, model)


def _run(args, model: str) -> dict:
    rng = np.random.default_rng(args.seed)
    user_lens = rng.integers(
        args.user_tokens[0], args.user_tokens[1] + 1, (args.conversations, args.turns)
    )
    block = 16
    blocks = args.num_kv_blocks or kv_blocks_needed(args, block)
    kw = dict(max_num_seqs=args.max_num_seqs, num_kv_blocks=blocks, block_size=block, seed=0)
    llms = {}
    for side, on in SIDES.items():
        print(f"[prefix_caching] loading {side}", file=sys.stderr, flush=True)
        llms[side] = LLM(model, enable_prefix_caching=on, **kw)
    vocab = llms["caching_on"].llm_engine.runner.vocab_size
    warm = np.random.default_rng([args.seed, 10**6])
    for llm in llms.values():
        llm.generate(
            [ids(warm, 48, vocab) for _ in range(8)],
            SamplingParams(max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )

    workloads = {"multi_turn": multi_turn, "no_shared": no_shared}
    runs: dict = {w: {s: [] for s in SIDES} for w in workloads}
    sample_runs: dict = {"n_caching_on": [], "n_caching_off": [], "separate_caching_off": []}
    for rep in range(args.repeats):
        for i, (w, make) in enumerate(workloads.items()):
            for side, llm in llms.items():
                print(f"[prefix_caching] run {rep} {w} {side}", file=sys.stderr, flush=True)
                turn = make(args, vocab, user_lens, np.random.default_rng([args.seed, rep, i]))
                runs[w][side].append(run_turns(llm, turn, args.turns, args.output_tokens))
        prompt = ids(np.random.default_rng([args.seed, rep, 2]), args.n_prompt_tokens, vocab)
        on, off = llms["caching_on"], llms["caching_off"]
        sample_runs["n_caching_on"].append(run_samples(on, prompt, args.n, False, True))
        sample_runs["n_caching_off"].append(run_samples(off, prompt, args.n, False, False))
        sample_runs["separate_caching_off"].append(run_samples(off, prompt, args.n, True, False))

    result: dict = {
        "model": f"shape:{args.shape}" if args.shape else model,
        "workload": {
            "conversations": args.conversations,
            "turns": args.turns,
            "system_tokens": args.system_tokens,
            "user_tokens": list(args.user_tokens),
            "output_tokens_per_turn": args.output_tokens,
            "sampling": "greedy, ignore_eos",
            "max_num_seqs": args.max_num_seqs,
            "num_kv_blocks": blocks,
            "block_size": block,
            "seed": args.seed,
        },
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
    }
    ratios = {}
    for w in workloads:
        result[w] = {side: best(rs) for side, rs in runs[w].items()}
        on, off = result[w]["caching_on"], result[w]["caching_off"]
        ratios[w] = {
            "throughput_on_over_off": round(
                on["output_tokens_per_s"] / off["output_tokens_per_s"], 3
            ),
            "ttft_p50_off_over_on": round(off["ttft_p50_s"] / on["ttft_p50_s"], 3),
        }
    result["ratios"] = ratios
    samples = {k: best(v) for k, v in sample_runs.items()}
    on, sep = samples["n_caching_on"], samples["separate_caching_off"]
    result["n_samples"] = {
        "n": args.n,
        "prompt_tokens": args.n_prompt_tokens,
        **samples,
        "prefill_tokens_n_on_over_separate_off": round(
            on["prefill_tokens_computed"] / sep["prefill_tokens_computed"], 3
        ),
        "seconds_n_on_over_separate_off": round(on["seconds"] / sep["seconds"], 3),
    }
    result["targets"] = {
        "multi_turn_throughput_2x": ratios["multi_turn"]["throughput_on_over_off"] >= 2.0,
        "multi_turn_ttft_p50_3x_lower": ratios["multi_turn"]["ttft_p50_off_over_on"] >= 3.0,
        "no_shared_at_most_3pct_slower": ratios["no_shared"]["throughput_on_over_off"] >= 0.97,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

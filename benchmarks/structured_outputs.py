"""Structured outputs: output tok/s with a JSON schema against unconstrained, same workload.

Workload: --num-requests prompts of --prompt-tokens random token ids (seeded, no special
tokens), sampled at temperature 1 with per-request seeds. The constrained side gives every
request one of --num-schemas JSON schemas (an order with a list of bounded items; they differ
in their field names, so each compiles once and the rest of its requests hit the grammar
cache). The unconstrained side then runs the same prompts with ignore_eos and max_tokens set to
what each request produced under its schema: both sides compute exactly the same number of
tokens per request. Runs are interleaved (--repeats); the fastest of each side counts; the
first constrained run also pays the compiles (counted in `grammar.compile_time_s`).

One LLM serves both sides (built once; one warm-up call is not timed). The model is --model
DIR, --shape NAME (a random-weight Llama from side_by_side.py, e.g. llama75m), or the demo
model. stdout has one JSON object; progress goes to stderr.

    python benchmarks/structured_outputs.py --shape llama75m
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from conveyor import LLM, SamplingParams
from conveyor.load_client.sibling import load_sibling

side_by_side = load_sibling(__file__, "side_by_side")


def schema(i: int, max_items: int = 4) -> dict:
    """Schema number i: the same shape under names of its own (a separate grammar)."""
    item = {
        "type": "object",
        "properties": {
            f"name_{i}": {"type": "string", "maxLength": 12},
            "quantity": {"type": "integer", "minimum": 0, "maximum": 999},
            "price": {"type": "number", "minimum": 0, "maximum": 100},
            "kind": {"enum": ["tool", "part", "kit"]},
        },
        "required": [f"name_{i}", "quantity", "kind"],
    }
    return {
        "type": "object",
        "properties": {
            f"order_{i}": {"type": "integer", "minimum": 1, "maximum": 99999},
            "items": {"type": "array", "items": item, "minItems": 1, "maxItems": max_items},
            "rush": {"type": "boolean"},
        },
        "required": [f"order_{i}", "items", "rush"],
    }


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [len(o.outputs[0].token_ids) for o in outs], outs


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF Llama checkpoint folder")
    src.add_argument("--shape", choices=sorted(side_by_side.SHAPES), default=None)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--num-schemas", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256, help="cap of the constrained side")
    p.add_argument("--max-items", type=int, default=4, help="items per order, at most")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="runs per side; the best counts")
    args = p.parse_args(argv)
    if not 1 <= args.num_schemas <= args.num_requests:
        p.error("--num-schemas must be in [1, --num-requests]")
    with side_by_side.model_folder(args, "structured_outputs") as model:
        return _run(args, model)


def _run(args, model: str) -> dict:
    print("[structured_outputs] loading", file=sys.stderr, flush=True)
    llm = LLM(model, max_num_seqs=args.max_num_seqs, seed=0)
    engine = llm.llm_engine
    vocab = engine.runner.vocab_size
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(100, vocab - 100, args.prompt_tokens).tolist()
               for _ in range(args.num_requests)]  # fmt: skip
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    constrained = [
        SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed + i,
                       structured_outputs={"json": schema(i % args.num_schemas, args.max_items)})
        for i in range(args.num_requests)
    ]  # fmt: skip
    runs: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    lengths: list[int] = []
    finished_stop = 0
    for rep in range(args.repeats):
        print(f"[structured_outputs] run {rep}", file=sys.stderr, flush=True)
        seconds, lengths, outs = timed(llm, prompts, constrained)
        runs["json_schema"].append(seconds)
        finished_stop = sum(o.outputs[0].finish_reason == "stop" for o in outs)
        free = [
            SamplingParams(max_tokens=n, temperature=1.0, seed=args.seed + i, ignore_eos=True)
            for i, n in enumerate(lengths)
        ]
        seconds, free_lengths, _ = timed(llm, prompts, free)
        assert free_lengths == lengths  # the same tokens computed on both sides
        runs["unconstrained"].append(seconds)

    tokens = sum(lengths)
    sides = {
        side: {
            "output_tokens": tokens,
            "seconds": min(times),
            "output_tokens_per_s": tokens / min(times),
            "all_seconds": times,
        }
        for side, times in runs.items()
    }
    ratio = (
        sides["json_schema"]["output_tokens_per_s"] / sides["unconstrained"]["output_tokens_per_s"]
    )
    cache = engine.grammars
    result = {
        "model": f"shape:{args.shape}" if args.shape else model,
        "workload": {
            "requests": args.num_requests,
            "schemas": args.num_schemas,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "max_items": args.max_items,
            "max_num_seqs": args.max_num_seqs,
            "sampling": "temperature 1, per-request seeds",
            "seed": args.seed,
        },
        "json_schema": sides["json_schema"],
        "unconstrained": sides["unconstrained"],
        "json_over_unconstrained_tok_s": ratio,
        "constrained_finished_stop": finished_stop,
        "grammar": {
            "compiles": cache.num_compiles,
            "compile_time_s": cache.compile_time_s,
            "compile_time_per_grammar_s": cache.compile_time_s / max(1, cache.num_compiles),
            "cache_queries": cache.num_queries,
            "cache_hits": cache.num_hits,
            "cache_hit_rate": cache.hit_rate,
        },
        "targets": {"at_most_10pct_slower": ratio >= 0.9},
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

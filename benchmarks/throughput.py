"""Offline throughput: conveyor's LLM.generate against transformers' generate, same workload.

A seeded workload on the demo model (or --model): prompt lengths uniform in
[--min-prompt, --max-prompt], output lengths drawn from an exponential distribution (chat-like)
clipped to [1, --max-output]. conveyor runs it with continuous batching at
max_num_seqs = --batch-size; transformers runs it in static padded batches of the same size
(left padding, greedy, each batch generating until its longest request is done). Only the
tokens each request asked for count, for both. Prints one JSON object.

Shared machines are noisy: each side runs --repeats times, interleaved (conveyor, transformers,
conveyor, ...), and the fastest run of each side is reported (with all the times). Every repeat
draws fresh prompt token ids (the same lengths and output lengths), and each side warms up on
prompts of its own, so no side reuses work it did before (conveyor's prefix cache would):
`prompt_tokens_from_cache` reports, per repeat, how many prompt tokens conveyor still found
cached. Progress bars (LLM.generate's prompts, transformers' batches) go to stderr; stdout has
only the JSON.

    python benchmarks/throughput.py --num-requests 256 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm

from conveyor import LLM, SamplingParams
from conveyor.model.loading.demo import demo_model_path


def make_workload(
    args, vocab_size: int, ids_seed: int | None = None
) -> tuple[list[list[int]], list[int]]:
    """Prompts (token ids) and output lengths. The lengths come from args.seed; the ids from
    `ids_seed` (default args.seed), so each repeat can draw fresh prompts of the same shape."""
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.min_prompt, args.max_prompt + 1, size=args.num_requests)
    out_lens = np.clip(
        np.ceil(rng.exponential(args.mean_output, size=args.num_requests)), 1, args.max_output
    ).astype(int)
    if ids_seed is not None:
        rng = np.random.default_rng([args.seed, ids_seed])
    # Token ids from the middle of the vocabulary: plain text tokens, no specials.
    prompts = [rng.integers(100, vocab_size - 100, size=int(n)).tolist() for n in prompt_lens]
    return prompts, out_lens.tolist()


WARM_UP_IDS = 2**31  # make_workload's ids_seed for the warm-up prompts (repeats: 0, 1, ...)


def conveyor_runner(
    model: str, warm_up, batch_size: int, progress: bool = True, **engine_kwargs
) -> Callable[[list, list], tuple[float, int]]:
    """A function that runs a workload (prompts, out_lens) through LLM.generate and returns
    its seconds and how many prompt tokens came from the prefix cache. warm_up: a workload
    (prompts, out_lens) whose first batch runs once first."""
    llm = LLM(model, max_num_seqs=batch_size, max_num_batched_tokens=2048, seed=0, **engine_kwargs)

    def params(out_lens):
        return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in out_lens]

    llm.generate(warm_up[0][:batch_size], params(warm_up[1][:batch_size]), use_tqdm=False)

    def run(prompts, out_lens) -> tuple[float, int]:
        start = time.perf_counter()
        outs = llm.generate(prompts, params(out_lens), use_tqdm=progress)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if tokens != sum(out_lens):
            raise RuntimeError(f"conveyor produced {tokens} tokens, expected {sum(out_lens)}")
        return seconds, sum(o.num_cached_tokens for o in outs)

    return run


def transformers_runner(
    model: str, warm_up, batch_size: int, progress: bool = True
) -> Callable[[list, list], tuple[float, None]]:
    """A function that runs a workload in static padded batches and returns its seconds (and
    None: it has no cache to take prompt tokens from); warm_up as for conveyor_runner."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = hf.generation_config.pad_token_id or hf.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    def batch_generate(ps, ls):
        width = max(len(p) for p in ps)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        n = max(ls)
        # min_new_tokens = max_new_tokens: no request stops early at eos, as with ignore_eos.
        return hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=pad,
        )

    with torch.inference_mode():
        batch_generate(warm_up[0][:batch_size], warm_up[1][:batch_size])

    @torch.inference_mode()
    def run(prompts, out_lens) -> tuple[float, None]:
        start = time.perf_counter()
        batches = range(0, len(prompts), batch_size)
        for i in tqdm(batches, desc="transformers batches", disable=not progress):
            batch_generate(prompts[i : i + batch_size], out_lens[i : i + batch_size])
        return time.perf_counter() - start, None

    return run


def _result(requests: int, tokens: int, runs: list[tuple[float, int | None]]) -> dict:
    """A side's summary from its runs' (seconds, prompt tokens from cache)."""
    times = [t for t, _ in runs]
    best = min(times)
    return {
        "requests": requests,
        "output_tokens": tokens,
        "seconds": round(best, 3),
        "all_seconds": [round(t, 3) for t in times],
        "output_tokens_per_s": round(tokens / best, 1),
        "prompt_tokens_from_cache": [c for _, c in runs],
    }


def run_interleaved(runners: dict, args, vocab: int) -> tuple[dict[str, list], list[int]]:
    """--repeats rounds of every runner in turn, each round on fresh prompts (ids_seed = the
    round) that every side gets. Returns each side's runs and the output lengths."""
    runs: dict[str, list] = {name: [] for name in runners}
    out_lens: list[int] = []
    for r in range(args.repeats):
        prompts, out_lens = make_workload(args, vocab, ids_seed=r)
        out_lens = [max(getattr(args, "min_output", 1), m) for m in out_lens]
        for name, run in runners.items():
            print(f"[benchmark] repeat {r}: {name}", file=sys.stderr, flush=True)
            runs[name].append(run(prompts, out_lens))
    return runs, out_lens


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: demo model)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--mean-output", type=float, default=64.0)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="runs per side; the best counts")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--compare-linear-torch",
        action="store_true",
        help="also run conveyor with linear_backend='torch' (nn.Linear) against the default",
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bars on stderr")
    args = p.parse_args(argv)
    progress = not args.disable_tqdm

    model = args.model or str(demo_model_path())
    vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
    warm = make_workload(args, vocab, ids_seed=WARM_UP_IDS)
    runners = {"conveyor": conveyor_runner(model, warm, args.batch_size, progress)}
    if args.compare_linear_torch:
        runners["conveyor_linear_torch"] = conveyor_runner(
            model, warm, args.batch_size, progress, linear_backend="torch"
        )
    if not args.skip_transformers:
        runners["transformers_static"] = transformers_runner(model, warm, args.batch_size, progress)
    times, out_lens = run_interleaved(runners, args, vocab)
    result = {
        "model": model,
        "batch_size": args.batch_size,
        "torch_threads": torch.get_num_threads(),
        "mean_output_tokens": args.mean_output,
        "prompt_tokens": [args.min_prompt, args.max_prompt],
    }
    for name, ts in times.items():
        result[name] = _result(args.num_requests, sum(out_lens), ts)
    if not args.skip_transformers:
        result["ratio_output_tokens_per_s"] = round(
            result["conveyor"]["output_tokens_per_s"]
            / result["transformers_static"]["output_tokens_per_s"],
            2,
        )
    if args.compare_linear_torch:
        result["ratio_default_to_linear_torch"] = round(
            result["conveyor"]["output_tokens_per_s"]
            / result["conveyor_linear_torch"]["output_tokens_per_s"],
            2,
        )
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

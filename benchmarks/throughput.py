"""Offline throughput: conveyor's LLM.generate against transformers' generate, same workload.

A seeded workload on the demo model (or --model): prompt lengths uniform in
[--min-prompt, --max-prompt], output lengths drawn from an exponential distribution (chat-like)
clipped to [1, --max-output]. conveyor runs it with continuous batching at
max_num_seqs = --batch-size; transformers runs it in static padded batches of the same size
(left padding, greedy, each batch generating until its longest request is done). Only the
tokens each request asked for count, for both. Prints one JSON object.

Shared machines are noisy: each side runs --repeats times, interleaved (conveyor, transformers,
conveyor, ...), and the fastest run of each side is reported (with all the times). Progress
bars (LLM.generate's prompts, transformers' batches) go to stderr; stdout has only the JSON.

    python benchmarks/throughput.py --num-requests 256 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm

from conveyor import LLM, SamplingParams
from conveyor.model.demo import demo_model_path


def make_workload(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.min_prompt, args.max_prompt + 1, size=args.num_requests)
    out_lens = np.clip(
        np.ceil(rng.exponential(args.mean_output, size=args.num_requests)), 1, args.max_output
    ).astype(int)
    # Token ids from the middle of the vocabulary: plain text tokens, no specials.
    prompts = [rng.integers(100, vocab_size - 100, size=int(n)).tolist() for n in prompt_lens]
    return prompts, out_lens.tolist()


def conveyor_runner(
    model: str, prompts, out_lens, batch_size: int, progress: bool = True, **engine_kwargs
):
    """A function that runs the whole workload through LLM.generate and returns seconds."""
    llm = LLM(model, max_num_seqs=batch_size, max_num_batched_tokens=2048, seed=0, **engine_kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in out_lens]
    llm.generate(prompts[:batch_size], params[:batch_size], use_tqdm=False)  # warm-up

    def run() -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=progress)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if tokens != sum(out_lens):
            raise RuntimeError(f"conveyor produced {tokens} tokens, expected {sum(out_lens)}")
        return seconds

    return run


def transformers_runner(model: str, prompts, out_lens, batch_size: int, progress: bool = True):
    """A function that runs the workload in static padded batches and returns seconds."""
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
        batch_generate(prompts[:batch_size], out_lens[:batch_size])  # warm-up

    @torch.inference_mode()
    def run() -> float:
        start = time.perf_counter()
        batches = range(0, len(prompts), batch_size)
        for i in tqdm(batches, desc="transformers batches", disable=not progress):
            batch_generate(prompts[i : i + batch_size], out_lens[i : i + batch_size])
        return time.perf_counter() - start

    return run


def _result(requests: int, tokens: int, times: list[float]) -> dict:
    best = min(times)
    return {
        "requests": requests,
        "output_tokens": tokens,
        "seconds": round(best, 3),
        "all_seconds": [round(t, 3) for t in times],
        "output_tokens_per_s": round(tokens / best, 1),
    }


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
    prompts, out_lens = make_workload(args, vocab)
    runners = {"conveyor": conveyor_runner(model, prompts, out_lens, args.batch_size, progress)}
    if args.compare_linear_torch:
        runners["conveyor_linear_torch"] = conveyor_runner(
            model, prompts, out_lens, args.batch_size, progress, linear_backend="torch"
        )
    if not args.skip_transformers:
        runners["transformers_static"] = transformers_runner(
            model, prompts, out_lens, args.batch_size, progress
        )
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            times[name].append(run())
    result = {
        "model": model,
        "batch_size": args.batch_size,
        "torch_threads": torch.get_num_threads(),
        "mean_output_tokens": args.mean_output,
        "prompt_tokens": [args.min_prompt, args.max_prompt],
    }
    for name, ts in times.items():
        result[name] = _result(len(prompts), sum(out_lens), ts)
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

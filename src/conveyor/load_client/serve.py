"""`conveyor bench serve`: drive a running OpenAI-compatible server and report its latencies.

Like `vllm bench serve`: requests from a synthetic workload (prompts of `input_len` tokens cut
from tokenized random words, `output_len` tokens out, ±range_ratio) or a JSONL file
(`{"prompt": text or token ids, "max_tokens": N}` per line) go to /v1/completions as streams,
with Poisson arrivals at `request_rate` (inf: all at once) and at most `max_concurrency` in
flight. Per request it records, from the client's side:

    sent ──── TTFT ────► chunk 1 ── ITL ──► chunk 2 ── ITL ──► ... last chunk
    └──────────────────────────── E2E latency ──────────────────────────┘
    TPOT = (E2E - TTFT) / (output tokens - 1)

and reports successful / failed requests, request and token throughput, and mean, median and
p99 of TTFT, TPOT, ITL and E2E in ms, as JSON (and a PNG of their CDFs with matplotlib).
Requests carry `--served-model-name` (default: the server's first /v1/models entry); a
progress bar of finished requests goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tqdm.auto import tqdm

from conveyor.load_client.client import request, stream_events

T = TypeVar("T")

# Synthetic prompts are windows of one tokenized text of these words.
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number point home water room mother area money story fact month lot night"
)


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `conveyor bench serve` flags (benchmarks/serve.py adds its own on top)."""
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    # Not --model: that is a checkpoint folder everywhere else (conveyor serve, benchmarks/).
    add("--served-model-name", metavar="NAME",
        help="model name requests send (default: the server's first /v1/models entry)")  # fmt: skip
    add("--api-key", help="sent as 'Authorization: Bearer KEY'")
    add("--dataset", type=Path, metavar="FILE", help="JSONL workload instead of synthetic")
    add("--num-prompts", type=int, default=200, metavar="N", help="requests (default 200)")
    add("--input-len", type=int, default=32, metavar="N", help="synthetic prompt tokens (32)")
    add("--output-len", type=int, default=64, metavar="N", help="max_tokens per request (64)")
    add("--range-ratio", type=float, default=0.0, metavar="R", help="lengths vary by ±R (0)")
    add("--request-rate", type=float, default=math.inf, metavar="R", help="Poisson rate/s (inf)")
    add("--max-concurrency", type=int, metavar="N", help="most requests in flight (no limit)")
    add("--seed", type=int, default=0, help="workload and arrival seed (0)")
    add("--result-json", type=Path, metavar="FILE", help="also write the result here")
    add("--plot", type=Path, metavar="FILE", help="write a PNG of the latency CDFs here")
    add("--disable-tqdm", action="store_true", help="no progress bar on stderr")


def require_matplotlib(what: str = "--plot") -> None:
    """Exit with a one-line message unless matplotlib imports: call it right after parsing,
    so a missing extra stops the run before the benchmark, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            f"{what} needs matplotlib, which is not installed: pip install -e '.[bench]'"
        ) from None


def lengths_within(n: int, mean: int, ratio: float, rng: random.Random) -> list[int]:
    """n lengths drawn uniformly from mean ± ratio (at least 1)."""
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


async def synthetic_workload(args: argparse.Namespace) -> list[BenchRequest]:
    """Prompts of exact token lengths: windows of one tokenized text of random words."""
    rng = random.Random(args.seed)
    in_lens = lengths_within(args.num_prompts, args.input_len, args.range_ratio, rng)
    out_lens = lengths_within(args.num_prompts, args.output_len, args.range_ratio, rng)
    words = _WORDS.split()
    text = " ".join(rng.choice(words) for _ in range(max(in_lens) * 2 + 64))
    body = {"prompt": text, "add_special_tokens": False}
    async with request(args.base_url, "POST", "/tokenize", body, _headers(args)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/tokenize answered {resp.status}: {(await resp.read())[:200]!r}")
        ids = (await resp.json())["tokens"]
    requests = []
    for n, m in zip(in_lens, out_lens, strict=True):
        start = rng.randrange(0, len(ids) - n + 1)
        requests.append(BenchRequest(ids[start : start + n], m))
    return requests


def load_jsonl(path: Path, limit: int | None = None) -> list[BenchRequest]:
    """Read `{"prompt": ..., "max_tokens": N}` lines (blank lines skipped)."""
    requests = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            requests.append(BenchRequest(row["prompt"], int(row.get("max_tokens", 64))))
    return requests[:limit] if limit else requests


async def workload(args: argparse.Namespace) -> list[BenchRequest]:
    """The requests the flags describe: --dataset's lines, else the synthetic workload."""
    if args.dataset is not None:
        return load_jsonl(args.dataset, args.num_prompts)
    return await synthetic_workload(args)


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _one(url: str, headers: dict[str, str], model: str, req: BenchRequest) -> RequestResult:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    finish: list[str | None] = [None]
    start = time.perf_counter()
    marks: list[float] = []  # arrival time of each event that carries a choice

    def on_event(payload: bytes) -> None:
        now = time.perf_counter()
        # Most events are one token of one choice: stamp them without parsing the JSON.
        if b'"finish_reason":null' in payload and b'"usage"' not in payload:
            marks.append(now)
            return
        if payload == b"[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            result.error = chunk["error"].get("message", "error event")
        if chunk.get("usage"):
            result.prompt_tokens = chunk["usage"]["prompt_tokens"]
            result.output_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", ()):
            marks.append(now)
            finish[0] = choice.get("finish_reason") or finish[0]

    try:
        status, error = await stream_events(url, "/v1/completions", body, on_event, headers)
    except Exception as exc:  # a failed request is counted, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    if status != 200:
        result.error = f"HTTP {status}: {error[:200]!r}"
    elif marks:
        result.ttft = marks[0] - start
        result.itl = [b - a for a, b in itertools.pairwise(marks)]
    result.ok = result.error is None and finish[0] in ("length", "stop")
    if result.error is None and not result.ok:
        result.error = f"finish_reason {finish[0]!r}"
    return result


async def run_requests(
    url: str,
    headers: dict[str, str],
    model: str,
    requests: list[BenchRequest],
    rate: float,
    concurrency: int | None,
    seed: int,
    progress: tqdm | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at `rate`/s, inf: at once); returns the results
    in request order and the wall time from the first send to the last answer. `progress`
    advances by one per answered request."""
    rng = random.Random(seed + 1)
    gate = asyncio.Semaphore(concurrency) if concurrency else None

    async def limited(req: BenchRequest) -> RequestResult:
        if gate is None:
            result = await _one(url, headers, model, req)
        else:
            async with gate:
                result = await _one(url, headers, model, req)
        if progress is not None:
            progress.update()
        return result

    start = time.perf_counter()
    tasks = []
    for req in requests:
        tasks.append(asyncio.create_task(limited(req)))
        if rate != math.inf:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values_s) or [0.0]
    p99 = ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)]
    return {
        f"mean_{name}_ms": round(statistics.fmean(ms), 3),
        f"median_{name}_ms": round(statistics.median(ms), 3),
        f"p99_{name}_ms": round(p99, 3),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """vllm-bench-serve-style metrics of one run."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": round(duration, 3),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
    }
    summary |= _stats("ttft", [r.ttft for r in ok])
    summary |= _stats("tpot", tpot)
    summary |= _stats("itl", [x for r in ok for x in r.itl])
    summary |= _stats("e2el", [r.e2e for r in ok])
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def plot(results: list[RequestResult], path: Path, title: str) -> None:
    """Write CDFs of TTFT, TPOT, ITL and E2E latency (ms) as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    series = {
        "TTFT": [r.ttft for r in ok],
        "TPOT": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "ITL": [x for r in ok for x in r.itl],
        "E2E latency": [r.e2e for r in ok],
    }
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        ms = sorted(v * 1000 for v in values)
        ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))] if ms else [])
        ax.set(title=name, xlabel="ms", ylabel="fraction of requests" if name == "TTFT" else "")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def bench(args: argparse.Namespace, requests: list[BenchRequest] | None = None) -> dict:
    """Run one benchmark; `requests` overrides the workload the flags describe.

    Returns:
        the summary (also written to --result-json, with --plot as a PNG).
    """
    headers = _headers(args)
    model = args.served_model_name
    if model is None:
        async with request(args.base_url, "GET", "/v1/models", None, headers) as resp:
            model = (await resp.json())["data"][0]["id"]
    if requests is None:
        requests = await workload(args)
    bar = tqdm(
        total=len(requests), desc="requests", unit="req", file=sys.stderr, disable=args.disable_tqdm
    )
    with bar:
        results, duration = await run_requests(
            args.base_url, headers, model, requests, args.request_rate, args.max_concurrency,
            args.seed, bar,
        )  # fmt: skip
    summary = {
        "model": model,
        "num_prompts": len(requests),
        "request_rate": "inf" if args.request_rate == math.inf else args.request_rate,
        "max_concurrency": args.max_concurrency,
        **summarize(results, duration),
    }
    if args.result_json is not None:
        args.result_json.write_text(json.dumps(summary, indent=2))
    if args.plot is not None:
        plot(
            results, args.plot, f"{model}: {len(requests)} requests, rate {summary['request_rate']}"
        )
    return summary


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop where it is installed: the client spends about a third less
    CPU per streamed event, CPU that the server it measures would otherwise lose to it on
    a small machine."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main(args: argparse.Namespace) -> int:
    """`conveyor bench serve`: print the summary as JSON; 1 if any request failed."""
    if args.plot is not None:
        require_matplotlib()
    summary = run(bench(args))
    print(json.dumps(summary, indent=2))
    return 0 if summary["failed_requests"] == 0 else 1

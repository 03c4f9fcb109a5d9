"""One request holding up everyone else (issue 49 item 4): a steady chat client beside each
attack, against a real `conveyor serve`.

A steady client sends an 8-token chat request (ignore_eos, temperature 0), one after another;
its latency alone (unloaded) is measured first, then its p50 and max while each attack runs:

    embeddings     /v1/embeddings with 24 inputs of 2,000 token ids (--embedding-inputs 256:
                   the issue's worst case)
    prompts        /v1/completions with 12 prompts of 2,000 token ids, max_tokens 1
    long-prompt    one 8,000-token prompt, max_tokens 1
    samples        4 requests at once of n=16, 300 tokens (ignore_eos), logprobs 20

The server started here has two API keys, one for the steady client and one for the
attacker, so per-client limits (--max-client-sequences, --max-client-tokens) tell them apart;
--serve-arg passes any other `conveyor serve` flag (`--serve-arg=--long-prefill-token-threshold
--serve-arg=0` is the old scheduling, without the long-prefill rule). stdout has one JSON
object; progress goes to stderr. The machine's load moves the numbers: compare runs made side
by side.

    python benchmarks/prefill_attacks.py --model SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_server import start_server

STEADY_KEY, ATTACK_KEY = "sk-steady", "sk-attacker"
STEADY_BODY = {"model": "demo", "messages": [{"role": "user", "content": "Say hi."}],
               "max_tokens": 8, "ignore_eos": True, "temperature": 0}  # fmt: skip


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Steady:
    """Sends the steady chat request back to back from a thread; `latencies(start, end)`:
    those of the requests that overlapped [start, end] (the one in flight when an attack
    starts counts: a stall shows as its latency)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done: list[tuple[float, float]] = []  # (start, seconds)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, headers=_auth(STEADY_KEY), timeout=900) as http:
            while not self._stop.is_set():
                start = time.monotonic()
                resp = http.post("/v1/chat/completions", json=STEADY_BODY)
                if resp.status_code != 200:
                    self.errors.append(f"{resp.status_code}: {resp.text[:200]}")
                    time.sleep(0.5)
                    continue
                self.done.append((start, time.monotonic() - start))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(900)

    def latencies(self, start: float, end: float) -> list[float]:
        return [s for t, s in self.done if t <= end and t + s >= start]


def summary(latencies: list[float], unloaded_p50: float | None = None) -> dict[str, Any]:
    if not latencies:
        return {"n": 0}
    p50 = statistics.median(latencies)
    out: dict[str, Any] = {"n": len(latencies), "p50_s": round(p50, 4),
                           "max_s": round(max(latencies), 4)}  # fmt: skip
    if unloaded_p50:
        out["p50_x"] = round(p50 / unloaded_p50, 2)
        out["max_x"] = round(max(latencies) / unloaded_p50, 2)
    return out


def ids(seed: int, length: int) -> list[int]:
    """Token ids no other input shares a prefix with (no prefix-cache hits between them)."""
    return [10 + (seed * 7919 + j * 104729 + j * j) % 8000 for j in range(length)]


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> int:
    return http.post(path, json={"model": "demo", **body}).status_code


def attacks(args: argparse.Namespace) -> dict[str, Any]:
    """name -> a function running that attack with an httpx client; returns its statuses."""
    toks = args.input_tokens

    def embeddings(http: httpx.Client) -> list[int]:
        inputs = [ids(1000 + i, toks) for i in range(args.embedding_inputs)]
        return [_post(http, "/v1/embeddings", {"input": inputs})]

    def prompts(http: httpx.Client) -> list[int]:
        batch = [ids(2000 + i, toks) for i in range(args.prompts)]
        return [_post(http, "/v1/completions", {"prompt": batch, "max_tokens": 1})]

    def long_prompt(http: httpx.Client) -> list[int]:
        return [_post(http, "/v1/completions", {"prompt": ids(3000, args.long_tokens),
                                                "max_tokens": 1})]  # fmt: skip

    def samples(http: httpx.Client) -> list[int]:
        body = {"prompt": "Once upon a time", "n": args.n, "max_tokens": args.sample_tokens,
                "ignore_eos": True, "logprobs": args.logprobs}  # fmt: skip
        with ThreadPoolExecutor(args.sample_requests) as pool:
            futures = [pool.submit(_post, http, "/v1/completions", body)
                       for _ in range(args.sample_requests)]  # fmt: skip
            return [f.result() for f in futures]

    table = {"embeddings": embeddings, "prompts": prompts, "long-prompt": long_prompt,
             "samples": samples}  # fmt: skip
    return {name: table[name] for name in args.attacks}


def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    steady = Steady(url)
    steady.start()

    def wait_for(count: int) -> None:
        while len(steady.done) < count:
            if steady.errors:
                raise RuntimeError(f"the steady client failed: {steady.errors[0]}")
            time.sleep(0.05)

    wait_for(2 + args.unloaded)  # the first two warm it up: its prefix is cached
    unloaded = [s for _, s in steady.done[2 : 2 + args.unloaded]]
    base = statistics.median(unloaded)
    log(f"unloaded: p50 {base:.3f} s over {len(unloaded)} requests")
    results: dict[str, Any] = {}
    windows: dict[str, tuple[float, float]] = {}
    with httpx.Client(base_url=url, headers=_auth(ATTACK_KEY), timeout=1800) as http:
        for name, attack in attacks(args).items():
            start = time.monotonic()
            statuses = attack(http)
            windows[name] = (start, time.monotonic())
            results[name] = {"attack_s": round(windows[name][1] - start, 2), "statuses": statuses}
            log(f"{name}: {json.dumps(results[name])}")
            time.sleep(args.pause)  # (the steady request held up by it finishes meanwhile)
    steady.stop()
    for name, (start, end) in windows.items():  # now that every request overlapping it ended
        results[name]["steady"] = summary(steady.latencies(start, end), base)
        log(f"{name}: steady {json.dumps(results[name]['steady'])}")
    return {"steady_unloaded": summary(unloaded), "attacks": results,
            "steady_errors": steady.errors[:5]}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server with keys sk-steady and sk-attacker")
    parser.add_argument("--model", help="checkpoint or .gguf for the started server (demo)")
    parser.add_argument("--serve-arg", action="append", default=[], dest="serve_args",
                        help="another `conveyor serve` flag or value (repeat)")  # fmt: skip
    parser.add_argument("--max-client-sequences", type=int, default=None,
                        help="the started server's per-client sequence limit")  # fmt: skip
    names = ["embeddings", "prompts", "long-prompt", "samples"]
    parser.add_argument("--attacks", nargs="+", default=names, choices=names)
    parser.add_argument("--unloaded", type=int, default=10, help="steady requests alone")
    parser.add_argument("--embedding-inputs", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--input-tokens", type=int, default=2000)
    parser.add_argument("--long-tokens", type=int, default=8000)
    parser.add_argument("--sample-requests", type=int, default=4)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--sample-tokens", type=int, default=300)
    parser.add_argument("--logprobs", type=int, default=20)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between attacks")
    args = parser.parse_args(argv)
    extra = list(args.serve_args)
    if args.max_client_sequences is not None:
        extra += ["--max-client-sequences", str(args.max_client_sequences)]
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(["--api-key", STEADY_KEY, ATTACK_KEY, *extra], args.model)
    try:
        report = run(url, args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    report["server_args"] = extra
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

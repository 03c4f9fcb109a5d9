"""Serving benchmark: `conveyor serve` over HTTP against LLM.generate on the same workload.

Starts `conveyor serve` (demo model unless --model, a checkpoint folder; --served-model-name
goes to the server and names the requests) on a free port with the engine flags below and
warms it up; then, --rounds times, runs `conveyor bench serve`'s driver against it
(synthetic workload, all requests at once unless --request-rate) and the same prompts and
max_tokens through LLM.generate with the same engine settings in this process, alternating
so that both see the same machine state; finally stops the server with SIGTERM (it must exit
0). The server runs its engine in its own process unless --no-engine-process. LLM.generate
runs in a worker thread, as the engine process steps its engine (on a busy 2-core box,
torch's two OpenMP threads can crawl when started from the main thread). Reports

    ratio = server output tokens/s / LLM.generate output tokens/s   (median over rounds)

Target: >= 0.85 with all requests at once (the HTTP and streaming path is not the
bottleneck). Writes benchmarks/results/serve.json and serve_latency.png. Progress bars (the
client's requests, LLM.generate's prompts) go to stderr.

    python benchmarks/serve.py --num-prompts 200 --input-len 32 --output-len 64
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from conveyor import LLM, SamplingParams
from conveyor.bench.serve import (
    BenchRequest,
    add_arguments,
    bench,
    require_matplotlib,
    run,
    synthetic_workload,
)

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def conveyor_command() -> list[str]:
    script = Path(sys.executable).with_name("conveyor")
    found = str(script) if script.is_file() else shutil.which("conveyor")
    return [found] if found else [sys.executable, "-m", "conveyor.cli"]


def _engine_flags(args: argparse.Namespace) -> dict[str, object]:
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_kv_blocks": args.num_kv_blocks,
        "scheduler": args.scheduler,
    }


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    """The `conveyor serve` command line for these benchmark flags."""
    command = [*conveyor_command(), "serve", "--port", str(port), "--log-level", "warning"]
    command += ["--log-stats-interval", "0", "--max-waiting-requests", "100000"]
    if args.model:
        command += ["--model", args.model]
    if args.served_model_name:
        command += ["--served-model-name", args.served_model_name]
    for key, value in _engine_flags(args).items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    command += ["--engine-process" if args.engine_process else "--no-engine-process"]
    return command


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(server_command(args, port))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 300)
    except RuntimeError:
        proc.kill()
        raise
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server for {url} did not become healthy in {timeout_s} s")


def llm_generate(args: argparse.Namespace, requests: list) -> Callable[[], float]:
    """An LLM with the server's engine settings; the returned function runs the workload
    through LLM.generate in a worker thread (as the server steps its engine) and returns its
    output tokens per second."""
    llm = LLM(args.model, seed=0, **_engine_flags(args))
    prompts = [r.prompt for r in requests]
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests
    ]
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(llm.generate, prompts[: args.max_num_seqs], warm, use_tqdm=False).result()

    def timed() -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return round(tokens / (time.perf_counter() - start), 2)

    def run() -> float:
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(timed).result()

    return run


def build_parser() -> argparse.ArgumentParser:
    """`conveyor bench serve`'s flags plus the server's model and engine flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    add = parser.add_argument
    add("--model", help="HF checkpoint folder (default: the demo model)")
    add("--max-num-seqs", type=int, default=64)
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--num-kv-blocks", type=int, default=1024)
    add("--scheduler", default="fifo")
    add("--engine-process", action=argparse.BooleanOptionalAction, default=True,
        help="the server's engine in its own process (default, as `conveyor serve`)")  # fmt: skip
    add("--rounds", type=int, default=3, help="server / LLM.generate rounds, alternated (3)")
    parser.set_defaults(
        result_json=ROOT / "benchmarks/results/serve.json",
        plot=ROOT / "benchmarks/results/serve_latency.png",
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.plot is not None:
        require_matplotlib()
    proc, args.base_url = start_server(args)
    quiet = argparse.Namespace(**{**vars(args), "result_json": None, "plot": None})
    rounds = []
    try:
        requests = run(synthetic_workload(args))
        # Warm-up: one full batch of short requests (torch's first calls are slow).
        warm = [BenchRequest(r.prompt, 4) for r in requests[: args.max_num_seqs]]
        run(bench(quiet, warm))
        generate = llm_generate(args, requests)
        # This process now holds a whole LLM; keep the cyclic GC, which the client's per-event
        # garbage triggers, from rescanning it (the server does the same for its own state).
        gc.collect()
        gc.freeze()
        # Alternate the two on the same machine state; an idle server costs nothing.
        for i in range(args.rounds):
            last = i == args.rounds - 1
            summary = run(bench(args if last else quiet, requests))
            rounds.append((summary, generate()))
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(60)
    ratios = [s["output_throughput"] / t for s, t in rounds]
    result = {
        "server": rounds[-1][0],
        "server_exit_code": exit_code,
        "server_output_throughput_per_round": [s["output_throughput"] for s, _ in rounds],
        "llm_generate_output_throughput_per_round": [t for _, t in rounds],
        "ratio_per_round": [round(r, 3) for r in ratios],
        "ratio_server_to_llm_generate_median": round(statistics.median(ratios), 3),
        "engine_process": args.engine_process,
        "engine": _engine_flags(args),
    }
    args.result_json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

"""Serving benchmark: `conveyor serve` over HTTP against LLM.generate on the same workload.

Starts `conveyor serve` (the demo model; --model, a checkpoint folder; or --shape, one of
side_by_side.py's random-weight Llamas; --served-model-name goes to the server and names the
requests) on a free port with the engine flags below and warms it up; then, --rounds times,
runs `conveyor bench serve`'s driver against it (all requests at once unless
--request-rate) and the same prompts and max_tokens through LLM.generate with the same
engine settings in this process, alternating so that both see the same machine state;
finally stops the server with SIGTERM (it must exit 0). The prompts are --dataset's, else
synthetic: windows of tokenized words, or with --shape random token ids below its
vocabulary (smaller than its tokenizer's). The server runs its engine in its own process
unless --no-engine-process. LLM.generate runs in a worker thread, as the engine process
steps its engine (on a busy 2-core box, torch's two OpenMP threads can crawl when started
from the main thread). Reports, from the output tokens/s of each side's rounds:

    ratio_best   = the server's best round / LLM.generate's best round
    ratio_median = the median over rounds of server / LLM.generate in the same round

Target: both >= 0.9 with all requests at once (the HTTP and streaming path is not the
bottleneck). Writes benchmarks/results/serve.json and serve_latency.png. Progress bars (the
client's requests, LLM.generate's prompts) go to stderr.

    python benchmarks/serve.py --shape llama75m --max-num-seqs 16 --num-prompts 64 --rounds 5
"""

from __future__ import annotations

import argparse
import gc
import json
import random
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
from conveyor.load_client.serve import (
    BenchRequest,
    add_arguments,
    bench,
    lengths_within,
    require_matplotlib,
    run,
    workload,
)
from conveyor.load_client.sibling import load_sibling

ROOT = Path(__file__).resolve().parents[1]
side_by_side = load_sibling(__file__, "side_by_side")
SHAPES = sorted(side_by_side.SHAPES)


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


def random_workload(args: argparse.Namespace, model: str) -> list[BenchRequest]:
    """Prompts of random token ids below the checkpoint's vocabulary (the shapes' vocabulary
    is smaller than their tokenizer's, as in side_by_side.py), lengths within ±range_ratio."""
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    in_lens = lengths_within(args.num_prompts, args.input_len, args.range_ratio, rng)
    out_lens = lengths_within(args.num_prompts, args.output_len, args.range_ratio, rng)
    return [
        BenchRequest([rng.randrange(3, vocab) for _ in range(n)], m)
        for n, m in zip(in_lens, out_lens, strict=True)
    ]


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
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="HF checkpoint folder (default: the demo model)")
    source.add_argument("--shape", choices=SHAPES, help="side_by_side.py's random-weight Llama")
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
    with side_by_side.model_folder(args, "serve") as model:
        if args.shape:
            args.model = model
        rounds, exit_code = _measure(args)
    servers = [s["output_throughput"] for s, _ in rounds]
    generates = [t for _, t in rounds]
    ratios = [s / t for s, t in zip(servers, generates, strict=True)]
    result = {
        "model": f"shape:{args.shape}" if args.shape else args.model or "demo",
        "server": rounds[-1][0],
        "server_exit_code": exit_code,
        "server_output_throughput_per_round": servers,
        "llm_generate_output_throughput_per_round": generates,
        "ratio_per_round": [round(r, 3) for r in ratios],
        "ratio_best": round(max(servers) / max(generates), 3),
        "ratio_median": round(statistics.median(ratios), 3),
        "engine_process": args.engine_process,
        "engine": _engine_flags(args),
    }
    args.result_json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


def _measure(args: argparse.Namespace) -> tuple[list[tuple[dict, float]], int]:
    """The alternated rounds: (server summary, LLM.generate tokens/s) each; the server's exit
    code."""
    proc, args.base_url = start_server(args)
    quiet = argparse.Namespace(**{**vars(args), "result_json": None, "plot": None})
    rounds = []
    try:
        if args.shape and args.dataset is None:
            requests = random_workload(args, args.model)
        else:
            requests = run(workload(args))
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
    return rounds, exit_code


if __name__ == "__main__":
    main()

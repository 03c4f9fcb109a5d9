"""conveyor against llama.cpp's llama-server on the same GGUF file: speed and memory.

For each --file and each --streams count, each side runs --repeats times, interleaved
(conveyor, llama.cpp, conveyor, ...), one server at a time, each started fresh for its run
and at its own defaults (llama-server gets `-np STREAMS`, its slots, and a context that
holds them; conveyor serve nothing). The same client (`conveyor bench serve`'s) sends the same
requests to both: --num-prompts prompts of random words (about --input-len tokens; a new seed
every repeat, so no side can reuse an earlier repeat's prompts), --output-len tokens out,
greedy, ignore_eos, at most STREAMS in flight.

Memory: the server's process tree's resident set (conveyor: the HTTP process and its engine
process) after a warm-up request, and for conveyor its split from the start-up log: the
weights ("GGUF weights in memory") and the KV cache; the rest is the runtime (Python, torch,
the tokenizer, buffers).

stdout: one JSON object, per file and streams count: each side's best and median output
tok/s, TPOT p50 and TTFT p50 (of its best run), RSS, and conveyor / llama.cpp ratios.

    python benchmarks/gguf_vs_llamacpp.py --llama-server BUILD/bin/llama-server \\
        --file SmolLM2-135M-Instruct.Q4_1.gguf --streams 1 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from conveyor.bench import serve as bench_serve
from conveyor.bench.serve import BenchRequest
from conveyor.bench.sibling import load_sibling

serve_bench = load_sibling(__file__, "serve")

_WORDS = bench_serve._WORDS.split()


def prompts(n: int, words: int, output_len: int, seed: int) -> list[BenchRequest]:
    """n prompts of `words` random words (about as many tokens): fresh for every seed."""
    rng = random.Random(seed)
    return [
        BenchRequest(f"{i}: " + " ".join(rng.choice(_WORDS) for _ in range(words)), output_len)
        for i in range(n)
    ]


def tree_rss_mib(pid: int) -> float:
    """Resident memory of pid and all its descendants, MiB."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def _start(command: list[str], log: Path, url: str) -> subprocess.Popen:
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[0]} exited {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{command[0]} did not become healthy")


def conveyor_split(log: str) -> dict[str, float]:
    """Weights and KV MiB from conveyor's start-up log."""
    split = {}
    if m := re.search(r"GGUF weights in memory: ([\d.]+) MiB", log):
        split["weights_mib"] = float(m.group(1))
    if m := re.search(r"KV cache: .*?\(([\d.]+) MiB\)", log):
        split["kv_mib"] = float(m.group(1))
    return split


def run_side(side: str, args: argparse.Namespace, file: Path, streams: int, seed: int) -> dict:
    port = serve_bench.free_port()
    url = f"http://127.0.0.1:{port}"
    if side == "conveyor":
        command = [*serve_bench.conveyor_command(), "serve", "--model", str(file)]
        command += ["--port", str(port), "--log-stats-interval", "0"]
    else:
        context = streams * (2 * args.input_len + args.output_len + 64)
        command = [str(args.llama_server), "-m", str(file), "--port", str(port)]
        command += ["-np", str(streams), "-c", str(max(context, 2048))]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        proc = _start(command, log, url)
        try:
            ns = argparse.Namespace(
                base_url=url, served_model_name=None, api_key=None, request_rate=math.inf,
                max_concurrency=streams, seed=seed, result_json=None, plot=None,
                disable_tqdm=True,
            )  # fmt: skip
            warm = [BenchRequest("warm up", 4)]
            bench_serve.run(bench_serve.bench(ns, warm))
            rss = tree_rss_mib(proc.pid)
            work = prompts(args.num_prompts, args.input_len, args.output_len, seed)
            summary = bench_serve.run(bench_serve.bench(ns, work))
            rss = max(rss, tree_rss_mib(proc.pid))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        text = log.read_text()
    result = {
        "output_tok_s": summary["output_throughput"],
        "tpot_p50_ms": summary["median_tpot_ms"],
        "ttft_p50_ms": summary["median_ttft_ms"],
        "failed": summary["failed_requests"],
        "rss_mib": round(rss, 1),
    }
    if side == "conveyor":
        split = conveyor_split(text)
        result.update(split)
        if len(split) == 2:
            result["runtime_mib"] = round(rss - split["weights_mib"] - split["kv_mib"], 1)
    print(f"{side} {file.name} streams={streams} seed={seed}: {result}", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--file", type=Path, nargs="+", required=True)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 8 x streams")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    report: dict = {"date": time.strftime("%Y-%m-%d"), "runs": []}
    for file in args.file:
        for streams in args.streams:
            args.num_prompts = args.num_prompts or 8 * streams
            runs: dict[str, list[dict]] = {"conveyor": [], "llama.cpp": []}
            for r in range(args.repeats):
                for side in runs:  # interleaved; the same fresh prompts for both sides
                    runs[side].append(run_side(side, args, file, streams, seed=1000 * r + streams))
            entry: dict = {"file": file.name, "streams": streams, "prompts": args.num_prompts}
            for side, results in runs.items():
                best = max(results, key=lambda x: x["output_tok_s"])
                entry[side] = {
                    **best,
                    "median_output_tok_s": statistics.median(x["output_tok_s"] for x in results),
                    "all_output_tok_s": [x["output_tok_s"] for x in results],
                }
            ours, theirs = entry["conveyor"], entry["llama.cpp"]
            entry["ratios"] = {
                "output_tok_s": ours["output_tok_s"] / theirs["output_tok_s"],
                "tpot_p50": ours["tpot_p50_ms"] / theirs["tpot_p50_ms"],
                "ttft_p50": ours["ttft_p50_ms"] / theirs["ttft_p50_ms"],
                "rss": ours["rss_mib"] / theirs["rss_mib"],
            }
            entry["file_mib"] = round(file.stat().st_size / 2**20, 1)
            report["runs"].append(entry)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

"""conveyor against its peers' servers (llama.cpp's llama-server, vllm serve) on one model.

Each side is a server command: conveyor serve at its defaults always (first, the side the
ratios are of), plus every --side NAME=COMMAND, a command line with {model}, {port},
{streams} and {context} filled in (each peer at its own defaults; a separate side for
matched precision). For every --streams count each side runs --repeats times, interleaved
(one server at a time, each started fresh for its run), and the same client
(`conveyor bench serve`'s) sends the same requests to every side: --num-prompts prompts of
random words (about --input-len tokens each; a new seed every repeat, so nothing an earlier
repeat cached is reused), --output-len tokens out, greedy, ignore_eos, at most STREAMS in
flight.

Memory: each server's process tree's resident set (conveyor: its HTTP process and its engine
process) after a warm-up request and after the run, the larger; for conveyor's sides also the split
from the start-up log: the weights ("Weights in memory", as packed for the kernels) and the KV
cache; the rest is the runtime (Python, torch, the tokenizer, buffers).

stdout: one JSON object: per streams count, each side's best and median output tok/s, TPOT
p50 and TTFT p50 (of its best run), RSS, and every side's ratios to conveyor.

    python benchmarks/serve_peers.py --model SmolLM2-135M-Instruct.Q4_1.gguf --streams 1 16 \\
        --side 'llama.cpp=BUILD/bin/llama-server -m {model} --port {port} -np {streams}
                -c {context}'   (one argument)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conveyor.load_client import serve as bench_serve
from conveyor.load_client.serve import BenchRequest
from conveyor.load_client.sibling import load_sibling

serve_bench = load_sibling(__file__, "serve")

_WORDS = bench_serve._WORDS.split()
CONVEYOR = "conveyor"


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


def conveyor_split(log: str) -> dict[str, float]:
    """Weights and KV MiB from conveyor's start-up log."""
    split = {}
    if m := re.search(r"Weights in memory: ([\d.]+) MiB", log):
        split["weights_mib"] = float(m.group(1))
    if m := re.search(r"KV cache: .*?\(([\d.]+) MiB\)", log):
        split["kv_mib"] = float(m.group(1))
    return split


def side_command(template: str, args: argparse.Namespace, streams: int, port: int) -> list[str]:
    context = max(2048, streams * (2 * args.input_len + args.output_len + 64))
    model = str(Path(args.model).resolve())  # servers run in a temporary folder
    fields = {"model": model, "port": port, "streams": streams, "context": context}
    return [part.format(**fields) for part in shlex.split(template)]


def _start(command: list[str], log: Path, url: str, timeout_s: float) -> subprocess.Popen:
    """The server, started in the log's folder: a peer run from this checkout would import
    its top-level packages (vLLM's transformers imports any `kernels` package it finds)."""
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    try:
        serve_bench.wait_healthy(proc, url, timeout_s)
    except RuntimeError as exc:
        proc.kill()
        raise RuntimeError(f"{command[0]}: {exc}\n{log.read_text()[-2000:]}") from None
    return proc


def run_side(name: str, template: str, args: argparse.Namespace, streams: int, seed: int) -> dict:
    port = serve_bench.free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        proc = _start(side_command(template, args, streams, port), log, url, args.start_timeout)
        try:
            ns = argparse.Namespace(
                base_url=url, served_model_name=None, api_key=None, request_rate=math.inf,
                max_concurrency=streams, seed=seed, result_json=None, plot=None,
                disable_tqdm=True,
            )  # fmt: skip
            bench_serve.run(bench_serve.bench(ns, [BenchRequest("warm up", 4)]))
            rss = tree_rss_mib(proc.pid)
            work = prompts(args.num_prompts or 8 * streams, args.input_len, args.output_len, seed)
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
        "successful": summary["successful_requests"],
        "failed": summary["failed_requests"],
        "rss_mib": round(rss, 1),
    }
    split = conveyor_split(text)  # any side that is a conveyor server (a bf16 run, say)
    if split:
        result.update(split)
        if len(split) == 2:
            result["runtime_mib"] = round(rss - split["weights_mib"] - split["kv_mib"], 1)
    print(f"{name} streams={streams} seed={seed}: {result}", file=sys.stderr)
    return result


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--model", required=True, help="what {model} stands for: a .gguf file or a folder")
    add("--side", action="append", default=[], metavar="NAME=COMMAND",
        help="a peer's server command ({model}, {port}, {streams}, {context})")  # fmt: skip
    add("--conveyor-flags", default="", help="extra flags for conveyor serve")
    add("--streams", type=int, nargs="+", default=[1, 16])
    add("--num-prompts", type=int, default=None, help="default: 8 x streams")
    add("--input-len", type=int, default=128)
    add("--output-len", type=int, default=128)
    add("--repeats", type=int, default=3)
    add("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    ours = shlex.join(serve_bench.conveyor_command())
    sides = {CONVEYOR: f"{ours} serve --model {{model}} --port {{port}} --log-stats-interval 0"}
    sides[CONVEYOR] += f" {args.conveyor_flags}" if args.conveyor_flags else ""
    for spec in args.side:
        name, sep, command = spec.partition("=")
        if not sep or not command or name in sides:
            raise SystemExit(f"--side takes NAME=COMMAND with a new name, got {spec!r}")
        sides[name] = command
    report: dict = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "runs": []}
    if Path(args.model).is_file():
        report["file_mib"] = round(Path(args.model).stat().st_size / 2**20, 1)
    for streams in args.streams:
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        for r in range(args.repeats):
            for name, template in sides.items():  # interleaved, the same fresh prompts
                runs[name].append(run_side(name, template, args, streams, 1000 * r + streams))
        entry: dict = {"streams": streams, "input_len": args.input_len}
        entry["output_len"] = args.output_len
        for name, results in runs.items():
            best = max(results, key=lambda x: x["output_tok_s"])
            entry[name] = {
                **best,
                "median_output_tok_s": statistics.median(x["output_tok_s"] for x in results),
                "all_output_tok_s": [x["output_tok_s"] for x in results],
            }
        ours_best = entry[CONVEYOR]
        entry["ratios_conveyor_to"] = {
            name: {
                "output_tok_s": _ratio(ours_best["output_tok_s"], entry[name]["output_tok_s"]),
                "tpot_p50": _ratio(ours_best["tpot_p50_ms"], entry[name]["tpot_p50_ms"]),
                "ttft_p50": _ratio(ours_best["ttft_p50_ms"], entry[name]["ttft_p50_ms"]),
                "rss": _ratio(ours_best["rss_mib"], entry[name]["rss_mib"]),
            }
            for name in sides
            if name != CONVEYOR
        }
        report["runs"].append(entry)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

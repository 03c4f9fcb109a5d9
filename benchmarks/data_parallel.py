"""Data-parallel benchmark: output tokens/s of `conveyor serve --data-parallel-size N` for each N.

Starts one server per size (all at once; an idle server costs nothing), on the --shape
random-weight Llama (side_by_side.py's shapes; tiny3 by default, llama75m for the issue's
numbers) or --model, warms each up, then --rounds times runs `conveyor bench serve`'s driver
(random token-id prompts of --input-len, --output-len tokens each, all requests at once
unless --request-rate) against each size in turn, so
that all see the same machine state; finally stops them with SIGTERM (each must exit 0).
On CPU each replica is pinned to its own share of the cores (one core each for N = 2 on two
cores), while N = 1 uses torch's default threads over all of them. Reports

    speedup = output tokens/s at N / output tokens/s at the first size   (median over rounds)

and how many requests each replica finished (its `request_success_total`). stdout has one JSON
object; progress bars go to stderr.

    python benchmarks/data_parallel.py --shape llama75m --num-prompts 64 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess

import httpx

from conveyor.load_client.serve import BenchRequest, add_arguments, bench, run
from conveyor.load_client.sibling import load_sibling

side_by_side = load_sibling(__file__, "side_by_side")
serve = load_sibling(__file__, "serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    add = parser.add_argument
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="HF checkpoint folder instead of --shape")
    source.add_argument("--shape", choices=sorted(side_by_side.SHAPES), default="tiny3")
    add("--data-parallel-sizes", default="1,2", metavar="N,M", help="sizes to compare (1,2)")
    add("--max-num-seqs", type=int, default=64)
    add("--num-kv-blocks", type=int, default=512, help="KV blocks per replica (512)")
    add("--rounds", type=int, default=3, help="rounds over all sizes, alternated (3)")
    add("--startup-timeout", type=float, default=600.0, metavar="S")
    parser.set_defaults(served_model_name="dp-bench")
    return parser


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--data-parallel-sizes must list positive integers, got {text!r}")
    return sizes


def start_server(model: str, size: int, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = serve.free_port()
    command = [*serve.conveyor_command(), "serve", "--model", model, "--port", str(port)]
    command += ["--served-model-name", args.served_model_name, "--log-level", "warning"]
    command += ["--log-stats-interval", "0", "--max-waiting-requests", "100000"]
    command += ["--data-parallel-size", str(size), "--max-num-seqs", str(args.max_num_seqs)]
    command += ["--num-kv-blocks", str(args.num_kv_blocks)]
    return subprocess.Popen(command), f"http://127.0.0.1:{port}"


def finished_per_replica(url: str, size: int) -> list[float]:
    """Each replica's finished requests so far (the whole server's for size 1)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    counts = [0.0] * size
    for line in text.splitlines():
        if not line.startswith("conveyor:request_success_total{"):
            continue
        series, value = line.rsplit(" ", 1)
        replica = series.partition('replica="')[2].partition('"')[0]
        if size == 1:
            counts[0] += float(value)
        elif replica.isdigit():
            counts[int(replica)] += float(value)
    return counts


def _measure(args: argparse.Namespace, model: str, sizes: list[int]) -> dict:
    servers = {size: start_server(model, size, args) for size in sizes}
    exit_codes: dict[int, int | None] = {}
    rounds: dict[int, list[dict]] = {size: [] for size in sizes}
    try:
        for proc, url in servers.values():
            serve.wait_healthy(proc, url, args.startup_timeout)
        quiet = argparse.Namespace(**{**vars(args), "result_json": None, "plot": None})
        requests = serve.random_workload(args, model)
        warm = [BenchRequest(r.prompt, 4) for r in requests[: args.max_num_seqs]]
        for _, url in servers.values():
            run(bench(argparse.Namespace(**{**vars(quiet), "base_url": url}), warm))
        for _ in range(args.rounds):
            for size, (_, url) in servers.items():
                before = finished_per_replica(url, size)
                summary = run(
                    bench(argparse.Namespace(**{**vars(quiet), "base_url": url}), requests)
                )
                after = finished_per_replica(url, size)
                summary["finished_per_replica"] = [
                    a - b for a, b in zip(after, before, strict=True)
                ]
                rounds[size].append(summary)
    finally:
        for proc, _ in servers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for size, (proc, _) in servers.items():
            try:
                exit_codes[size] = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                exit_codes[size] = None
    return {"rounds": rounds, "exit_codes": exit_codes}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    sizes = _sizes(args.data_parallel_sizes)
    if args.model:
        measured = _measure(args, args.model, sizes)
    else:
        with side_by_side.model_folder(args, "data_parallel") as model:
            measured = _measure(args, model, sizes)
    rounds, base = measured["rounds"], sizes[0]
    per_size = {}
    for size in sizes:
        rates = [s["output_throughput"] for s in rounds[size]]
        speedups = [r / s["output_throughput"] for r, s in zip(rates, rounds[base], strict=True)]
        last = rounds[size][-1]
        per_size[str(size)] = {
            "output_throughput_per_round": rates,
            "output_throughput_median": round(statistics.median(rates), 2),
            "speedup_over_first_size_median": round(statistics.median(speedups), 3),
            "finished_per_replica_last_round": last["finished_per_replica"],
            "successful_requests_last_round": last["successful_requests"],
            "server_exit_code": measured["exit_codes"][size],
            "last_round": {k: v for k, v in last.items() if k != "finished_per_replica"},
        }
    result = {
        "model": args.model or f"shape:{args.shape}",
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "rounds": args.rounds,
        "cpu_cores": len(os.sched_getaffinity(0)),
        "load_average_at_end": [round(v, 2) for v in os.getloadavg()],
        "engine": {"max_num_seqs": args.max_num_seqs, "num_kv_blocks": args.num_kv_blocks},
        "data_parallel": per_size,
    }
    if args.result_json is not None:
        args.result_json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

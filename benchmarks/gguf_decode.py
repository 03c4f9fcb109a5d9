"""Single-stream decode speed against the memory floor: TPOT, CPU time a token, one step's linears.

On a GGUF file (for comparing with `llama-bench -m FILE -p 0 -n 64 -t T`) or a checkpoint
folder in --dtype (issue 28's bf16 floor). Per activation pass count (GGUF only; 1: llama.cpp's
arithmetic, 2: the default), after a warm-up, each repeat times a 1-token and an
(n + 1)-token greedy `LLM.generate` (ignore_eos) and takes the difference / n:

    tpot_ms        wall time a token (min over repeats)
    cpu_ms         the process's CPU time a token, all threads (min over repeats): on a shared
                   machine wall time includes time the kernels waited for a core, CPU time
                   does not (with one thread it is the kernels' own cost)
    linears_ms     every QuantLinear (GGUF) or CpuLinear (a checkpoint on our GEMM) of the
                   model once on a random row, back to back from Python (the decode step's
                   linears and the head, each call's Python included; min over 3 x repeats),
                   wall and CPU; `linears` counts them
    floor_ms       the memory floor of a token: the bytes a decode step reads (every weight
                   in memory, as loaded, but the embedding table, of which it reads one row,
                   unless the head shares it) / the read bandwidth (a 512 MiB tensor's sum on
                   torch's threads, on 2 MiB pages as the weights are, best of the samples
                   taken right after each repeat)
    tpot_to_floor  tpot_ms / floor_ms (issue 28's single-stream target: at most 1.2 in bf16)
    host_ms        a decode step's wall time outside the decoder layers' one C call and the
                   head (compute_logits): the runner's, sampler's and engine's own work, which
                   runs right after the kernels have streamed the weights through the caches
                   (median over one more generate's decode steps; absent when the layers do
                   not run as one C call)
    tpot_to_floor_paired  each repeat's TPOT over the floor at the mean of the bandwidth
                   sampled just before and just after it, the median over repeats: on a
                   machine whose read bandwidth moves within a run (this VM's swings between
                   about 50 and 85 GB/s), the best TPOT and the best bandwidth can come from
                   different moments, and this pairs each TPOT with its own

    llama_cpp      with --llama-bench: llama.cpp's `llama-bench` run once (`-r 1`, after its
                   own warm-up; `-p 0 -n --tokens -t` our thread count) after each of our
                   repeats, on --llama-model (default: --model when it is a GGUF; for a
                   checkpoint folder, e.g. its bf16 GGUF from llama.cpp's
                   `convert_hf_to_gguf.py --outtype bf16`), with a bandwidth sample after it
                   too: its tpot_ms (best) and tpot_ms_median, tpot_to_floor and
                   tpot_to_floor_paired against the same floor, and tpot_ratio, its best
                   over ours (above 1: ours is shorter)

Threads: torch's (set OMP_NUM_THREADS, or --threads).

    python benchmarks/gguf_decode.py --model SmolLM2-135M-Instruct.Q4_1.gguf --threads 1
    python benchmarks/gguf_decode.py --model SMOLLM2_FOLDER --dtype bfloat16
    python benchmarks/gguf_decode.py --model SMOLLM2_FOLDER --dtype bfloat16 --tokens 64 \
        --repeats 4 --llama-bench LLAMA_CPP/build/bin/llama-bench --llama-model smollm2-bf16.gguf

--kernels (no model file): one decoder layer's quantized linears (qkv, o, gate_up, down at
--shape's hidden, intermediate and kv widths; default TinyLlama-1.1B's 2048 5632 256) in each
--types type on random blocks, timed at each --rows count of activation rows (a decode step of
that many sequences), against the same layer's float32 GEMM (x @ W.T on the dequantized
weights, already in memory). With --baseline-src (the `src` folder of another checkout, e.g.
`git archive REV src | tar -x -C /tmp/base`) the same timing runs there too, in a subprocess,
rounds alternating with this tree's, and each result gets the baseline's ms and the ratio
baseline / this tree. Times are ms per layer, min and median over the samples. From
GEMM_ROWS (256) rows, where a layer switches to a GEMM on its weights dequantized a slice at a
time (bf16 panels with AVX512-BF16: csrc/quant_gemm.c; float32 on AVX2 and portable builds),
a result also has integer_kernels_ms: the same rows through the integer kernels instead.

    python benchmarks/gguf_decode.py --kernels --threads 2 --rows 64 256 1024 --no-gemm

    python benchmarks/gguf_decode.py --kernels --threads 2 --rows 1 16 64 \
        --baseline-src /tmp/base/src
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from conveyor import LLM, SamplingParams
from conveyor.load_client.sibling import load_sibling
from conveyor.model.cpu.linear import CpuLinear
from conveyor.model.cpu.quant_linear import QuantLinear
from conveyor.model.loading.loader import storage_bytes

PROMPT = [[1, 415, 5565, 349, 264]]


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of every weight a decode step reads: all of the model's tensors (each storage
    once) but those only the embedding table holds (a step reads one row of it)."""
    embed = model.model.embed_tokens
    tensors = [
        t
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if not name.startswith("model.embed_tokens.")
    ]
    if getattr(model, "lm_head", None) is None:  # tied: the logits read the whole table
        tensors += list(embed.parameters())
    return storage_bytes(tensors)


def host_ms(llm: LLM, generate: Callable[[], None]) -> float | None:
    """The median decode step's wall time (ms) outside the layers' one C call and the head,
    over the steps `generate` runs; None when the model's layers do not run as one C call."""
    engine = llm.llm_engine
    model = engine.runner.model
    fused = getattr(model, "fused_layers", None)
    if fused is None:
        return None
    inside, outside = [0.0], []

    def timed(fn: Callable) -> Callable:
        def call(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                inside[0] += time.perf_counter() - start

        return call

    def step() -> Any:
        inside[0], start = 0.0, time.perf_counter()
        out = engine_step()
        outside.append(time.perf_counter() - start - inside[0])
        return out

    engine_step, c_call = engine.step, fused._call
    fused._call, engine.step = timed(c_call), step
    model.compute_logits = timed(model.compute_logits)
    try:
        generate()
    finally:
        fused._call = c_call
        del model.compute_logits, engine.step  # the instance's wrappers: the class's again
    return 1e3 * statistics.median(outside[1:])  # the first step is the prompt's


def llama_bench(command: str, model: str, tokens: int) -> Callable[[], float]:
    """A function that runs llama.cpp's `llama-bench` (`command`, split like a shell line) once
    on `model`: `tokens` generated after an empty prompt (`-p 0 -n`), on this process's torch
    thread count, one repetition after its own warm-up; it returns the seconds a token."""
    argv = [*shlex.split(command), "-m", model, "-p", "0", "-n", str(tokens),
            "-t", str(torch.get_num_threads()), "-r", "1", "-o", "json"]  # fmt: skip

    def run() -> float:
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"llama-bench exited {out.returncode}: {out.stderr.strip()[-800:]}")
        rows = [r for r in json.loads(out.stdout) if r.get("n_prompt") == 0]
        if len(rows) != 1 or rows[0].get("n_gen") != tokens:
            raise SystemExit(f"llama-bench gave no single {tokens}-token generation: {rows}")
        return 1.0 / rows[0]["avg_ts"]

    return run


def _floor_ratios(tpot: list[float], around: list[tuple[float, float]], floor_s: float,
                  read: int) -> dict:  # fmt: skip
    """TPOT's best over the floor, and the median of each repeat's TPOT over the floor at the
    mean of the bandwidth sampled just before and just after it."""
    paired = [t * (a + b) / 2 * 1e9 / read for t, (a, b) in zip(tpot, around, strict=True)]
    return {
        "tpot_to_floor": round(min(tpot) / floor_s, 3),
        "tpot_to_floor_paired": round(statistics.median(paired), 3),
    }


def measure(model: str, passes: int, tokens: int, repeats: int, kv_blocks: int, dtype: str,
            peer: Callable[[], float] | None = None) -> dict:  # fmt: skip
    """One pass count's run (see the module docstring). `peer` (llama_bench's function), when
    given, runs after each of our repeats, with a bandwidth sample after it too."""
    llm = LLM(model, num_kv_blocks=kv_blocks, dtype=dtype, quant_activation_passes=passes)
    bandwidth = load_sibling(__file__, "linear_bf16").read_bandwidth_gbps

    def gen(n: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(PROMPT, params, use_tqdm=False)

    gen(4)  # warm-up: the kernels' build, the first step's allocations
    tpot, cpu, gbps = [], [], [bandwidth()]
    around, peer_tpot, peer_around = [], [], []  # each repeat's bandwidth before and after
    for _ in range(repeats):
        one, many = _timed(lambda: gen(1)), _timed(lambda: gen(tokens + 1))
        tpot.append((many[0] - one[0]) / tokens)
        cpu.append((many[1] - one[1]) / tokens)
        gbps.append(bandwidth())
        around.append((gbps[-2], gbps[-1]))
        if peer is not None:
            peer_tpot.append(peer())
            gbps.append(bandwidth())
            peer_around.append((gbps[-2], gbps[-1]))
    host = host_ms(llm, lambda: gen(tokens + 1))
    runner_model = llm.llm_engine.runner.model
    linears = [m for m in runner_model.modules() if isinstance(m, QuantLinear | CpuLinear)]
    xs = [torch.randn(1, m.in_features) for m in linears]

    def run_linears() -> None:
        for m, x in zip(linears, xs, strict=True):
            m(x)

    lin = [_timed(run_linears) for _ in range(3 * repeats)]
    read = bytes_per_token(runner_model)
    llm.shutdown()
    floor_ms = 1e3 * read / (max(gbps) * 1e9)
    result = {
        "passes": passes,
        "tpot_ms": round(1e3 * min(tpot), 3),
        "cpu_ms": round(1e3 * min(cpu), 3),
        "bytes_per_token_mib": round(read / 2**20, 1),
        "read_gbps": round(max(gbps), 1),
        "floor_ms": round(floor_ms, 3),
        **_floor_ratios(tpot, around, floor_ms / 1e3, read),
        "linears": len(linears),
        "quant_linears": sum(isinstance(m, QuantLinear) for m in linears),
    }
    if peer is not None:
        result["llama_cpp"] = {
            "tpot_ms": round(1e3 * min(peer_tpot), 3),
            "tpot_ms_median": round(1e3 * statistics.median(peer_tpot), 3),
            **_floor_ratios(peer_tpot, peer_around, floor_ms / 1e3, read),
            # llama.cpp's best time a token over ours (above 1: ours is shorter)
            "tpot_ratio": round(min(peer_tpot) / min(tpot), 3),
        }
    if host is not None:
        result["host_ms"] = round(host, 3)
    if linears:
        result["linears_ms"] = round(1e3 * min(t for t, _ in lin), 3)
        result["linears_cpu_ms"] = round(1e3 * min(c for _, c in lin), 3)
    return result


# --kernels: a decoder layer's linears on random blocks.
KERNEL_TYPES = ["Q4_K", "Q6_K", "Q5_K", "Q8_0", "Q4_0", "Q4_1"]


def _random_weight(qtype: str, rows: int, cols: int, rng: np.random.Generator):
    """Random quants (and K-quant sub-block scales) with small float16 scales: real blocks'
    layout and cost, not their values."""
    from conveyor.model.cpu.quant_linear import QUANT_TYPES, QuantTensor

    _, weights, size = QUANT_TYPES[qtype]
    nb = cols // weights
    blocks = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    at, count = {"Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1)}.get(
        qtype, (0, 1)
    )
    scales = rng.uniform(-0.01, 0.01, (rows, nb, count)).astype(np.float16)
    blocks[:, :, at : at + 2 * count] = scales.view(np.uint8).reshape(rows, nb, 2 * count)
    return QuantTensor(qtype, torch.from_numpy(blocks.reshape(rows, nb * size)), (rows, cols))


def _layer_shapes(hidden: int, inter: int, kv: int) -> list[tuple[int, int]]:
    """(out, in) of qkv, o, gate_up, down."""
    return [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]


def _stats(samples: list[float]) -> dict:
    ms = [1e3 * t for t in samples]
    return {"min": round(min(ms), 3), "median": round(statistics.median(ms), 3)}


def time_kernels(args, state: dict) -> dict:
    """Samples (seconds) per (type, rows): {"TYPE/ROWS": [...]} (and "TYPE/ROWS/gemm"),
    args.repeats of each, the configurations interleaved. `state` keeps the layers."""
    from conveyor.model.cpu import cpu_kernels
    from conveyor.model.cpu.quant_linear import QuantEmbedding, QuantLinear

    kernels = state.get("kernels") or cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the CPU C kernels cannot be built here")
    state["kernels"] = kernels
    shapes = _layer_shapes(*args.shape)
    rng = np.random.default_rng(0)
    for qtype in args.types:
        if qtype in state:
            continue
        layers, dense = [], []
        for n, k in shapes:
            w = _random_weight(qtype, n, k, rng)
            layer = QuantLinear([w], None, kernels, passes=args.passes)
            layers.append(layer)
            if args.gemm:
                emb = QuantEmbedding(w, kernels)
                dense.append(emb(torch.arange(n)).T.contiguous().T)  # [n, k] fp32
        state[qtype] = (layers, dense)
    gen = torch.Generator().manual_seed(1)
    xs = {m: [torch.randn(m, k, generator=gen) for _, k in shapes] for m in args.rows}
    samples: dict[str, list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for qtype in args.types:
                layers, dense = state[qtype]
                for m in args.rows:
                    runs = [("", layers)] + ([("/gemm", dense)] if dense else [])
                    switch = layers[0].gemm_rows
                    if switch is not None and m >= switch:  # also the integer kernels
                        runs.append(("/integer", layers))
                    for suffix, mods in runs:
                        t, c = time.perf_counter(), time.process_time()
                        for mod, x in zip(mods, xs[m], strict=True):
                            if suffix == "/gemm":
                                x @ mod.T
                                continue
                            mod.gemm_rows = None if suffix == "/integer" else switch
                            mod(x)
                            mod.gemm_rows = switch
                        c, t = time.process_time() - c, time.perf_counter() - t
                        samples.setdefault(f"{qtype}/{m}{suffix}", []).append(t)
                        samples.setdefault(f"{qtype}/{m}{suffix}/cpu", []).append(c)
    return samples


def kernels_main(args) -> dict:
    state: dict = {}
    time_kernels(args, state)  # warm-up (the build, first-touch of the weights)
    mine: dict[str, list[float]] = {}
    base: dict[str, list[float]] = {}
    rounds = max(1, args.rounds) if args.baseline_src else 1
    for _ in range(rounds):
        if args.baseline_src:
            cmd = [sys.executable, os.path.abspath(__file__), "--kernels", "--worker",
                   "--no-gemm", "--threads", str(torch.get_num_threads()),
                   "--passes", str(args.passes), "--repeats", str(args.repeats),
                   "--types", *args.types, "--rows", *map(str, args.rows),
                   "--shape", *map(str, args.shape)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": args.baseline_src}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            for key, v in json.loads(out.stdout)["samples"].items():
                base.setdefault(key, []).extend(v)
        for key, v in time_kernels(args, state).items():
            mine.setdefault(key, []).extend(v)
    if args.worker:
        result = {"samples": mine}
        print(json.dumps(result))
        return result
    results = []
    for qtype in args.types:
        for m in args.rows:
            key = f"{qtype}/{m}"
            row = {"type": qtype, "rows": m, "ms": _stats(mine[key])}
            row["cpu_ms"] = _stats(mine[key + "/cpu"])
            if key + "/gemm" in mine:
                row["fp32_gemm_ms"] = _stats(mine[key + "/gemm"])
            if key + "/integer" in mine:  # what ms took instead of the integer kernels
                row["integer_kernels_ms"] = _stats(mine[key + "/integer"])
            if key in base:
                row["baseline_ms"] = _stats(base[key])
                row["baseline_cpu_ms"] = _stats(base[key + "/cpu"])
                for name, new, old in (("ratio", "ms", "baseline_ms"),
                                       ("cpu_ratio", "cpu_ms", "baseline_cpu_ms")):  # fmt: skip
                    row[name] = {
                        s: round(row[old][s] / max(row[new][s], 1e-9), 2) for s in ("min", "median")
                    }
            results.append(row)
    result = {
        "mode": "kernels",
        "threads": torch.get_num_threads(),
        "passes": args.passes,
        "shape": {"hidden": args.shape[0], "intermediate": args.shape[1], "kv": args.shape[2]},
        "layer": [list(s) for s in _layer_shapes(*args.shape)],
        "samples_each": len(next(iter(mine.values()))),
        "baseline_src": args.baseline_src,
        "results": results,
    }
    print(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a .gguf file or a checkpoint folder")
    parser.add_argument("--dtype", default="float32", help="LLM's dtype (GGUF: float32)")
    parser.add_argument("--kernels", action="store_true", help="time a layer's linears")
    parser.add_argument(
        "--passes",
        type=int,
        nargs="+",
        default=None,
        choices=(1, 2),
        help="activation passes (default 1 2; --kernels: 2, the default's)",
    )
    parser.add_argument("--tokens", type=int, default=32, help="tokens per timed generate")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--kv-blocks", type=int, default=64)
    parser.add_argument("--types", nargs="+", default=KERNEL_TYPES, choices=KERNEL_TYPES)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--shape", type=int, nargs=3, default=[2048, 5632, 256],
                        metavar=("HIDDEN", "INTER", "KV"))  # fmt: skip
    parser.add_argument("--baseline-src", help="another checkout's src folder, to compare")
    parser.add_argument("--rounds", type=int, default=2, help="baseline/this tree alternations")
    parser.add_argument("--no-gemm", dest="gemm", action="store_false")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--llama-bench",
        metavar="COMMAND",
        help="llama.cpp's llama-bench, run after each repeat on --llama-model (a peer: never "
        "a dependency)",
    )
    parser.add_argument(
        "--llama-model", help="the GGUF file llama-bench reads (default: --model, if a GGUF)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernels:
        if args.passes and len(args.passes) > 1:
            parser.error("--kernels times one pass count")
        args.passes = args.passes[0] if args.passes else 2
        return kernels_main(args)
    if not args.model:
        parser.error("--model is required (or --kernels)")
    gguf = args.model.endswith(".gguf")
    args.passes = args.passes or ([1, 2] if gguf else [2])  # (passes: GGUF's kernels only)
    peer = None
    if args.llama_bench:
        llama_model = args.llama_model or (args.model if gguf else None)
        if llama_model is None:
            parser.error("--llama-bench on a checkpoint folder needs --llama-model (a GGUF)")
        peer = llama_bench(args.llama_bench, llama_model, args.tokens)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "runs": [
            measure(args.model, p, args.tokens, args.repeats, args.kv_blocks, args.dtype, peer)
            for p in args.passes
        ],
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

"""Two builds of the CPU kernels in one process: a decode step's layers and head, this tree's
against another checkout's, swapped generate by generate.

On this VM a comparison of two processes cannot see a few per cent: each process's memory
placement weighs more (docs/benchmarks.md, 2026-12-05: one build 4-17 % slower in ten pairs
of processes in a row, level when both ran in one process), and loops of C over the kernels
alone have disagreed with the model. So this loads one model (`LLM`, greedy, `--tokens` a
generate) and both kernel libraries, this tree's and the one `--baseline-src` builds (the
`src` folder of another checkout, e.g. `git archive REV src | tar -x -C /tmp/base`, built in
a subprocess and cached as usual), and for each of `--rounds` rounds runs one generate on
each side. A side is the library behind the fused layers' one C call
(`decoder_layers_f32`, model/cpu/fused_layers.py) and behind the head's GEMM (the
CpuLinear entry points: in a decode step only the head calls them). Per side: the medians
over its steps of the C call, of the head and of the whole engine step (the host's Python
included), in ms, and per step of a round the ratio this tree / baseline, whose median, 10th
and 90th percentiles are printed (below 1: this tree is faster). The read bandwidth is sampled
before the first round and after each (as gguf_decode.py's probe), and `per_round` gives each
round's samples on both sides of it with each side's medians of that round, so a run says
which of the VM's phases each round saw, and which rounds it changed phase in.

The baseline's `decoder_layers_f32` must take the descriptors this tree's fused_layers.py
builds (the same layer_desc / step_desc layout; a baseline from before the kernels' names
were `<op>_<weight>_<activation>` is bound by its old names, `conveyor_decoder_layers` and
`conveyor_linear_*`); a model whose layers do not run as one C call is refused.

    python benchmarks/layers_ab.py --model SMOLLM2_FOLDER --dtype bfloat16 \
        --baseline-src /tmp/base/src --rounds 20 --tokens 32
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import conveyor  # noqa: F401  (its OpenMP wait policy, set before torch loads libgomp)

# isort: split
import torch

from conveyor import LLM, SamplingParams
from conveyor.load_client.sibling import load_sibling

PROMPT = "The capital of France is"
# what is timed a step, by its key in a side's record: the label it is reported under
TIMED = {"c": "c_call", "head": "head", "step": "step"}
# A baseline library built before the C entry points were renamed: this tree's name -> its.
_NAMES_BEFORE = {
    "decoder_layers_f32": "conveyor_decoder_layers",
    "gemm_f32_f32": "conveyor_linear_f32",
    "gemm_bf16_f32": "conveyor_linear_bf16",  # the build's bf16 GEMM either way
    "gemm_bf16_bf16": "conveyor_linear_bf16",
}
_LIB_OF_SRC = (
    "from conveyor.model.cpu import cpu_kernels as k; m = k.load(); print(m.path if m else '')"
)


def baseline_library(src: str) -> str:
    """The kernel library another checkout's `src` builds (its own cpu_build, in a
    subprocess: the build's cache key covers the sources, so both builds stay cached)."""
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    out = subprocess.run(
        [sys.executable, "-c", _LIB_OF_SRC], env=env, capture_output=True, text=True,
        check=True, timeout=900,
    ).stdout.strip()  # fmt: skip
    if not out:
        raise SystemExit(f"{src}: its C kernels did not build")
    return out


def _bind(lib: ctypes.CDLL, name: str) -> Any:
    """`lib`'s entry point `name`, or its name before the rename (an older baseline)."""
    return getattr(lib, name) if hasattr(lib, name) else getattr(lib, _NAMES_BEFORE[name])


def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    pick = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)  # noqa: E731
    return {"median": round(statistics.median(xs), 3), "p10": pick(0.1), "p90": pick(0.9)}


def run(model: str, dtype: str, baseline: str, rounds: int, tokens: int) -> dict:
    llm = LLM(model, dtype=dtype, num_kv_blocks=64)
    runner_model = llm.llm_engine.runner.model
    fused = getattr(runner_model, "fused_layers", None)
    if fused is None:
        raise SystemExit(f"{model}: its layers do not run as one C call here")
    kernels = fused.kernels
    ours = kernels.path
    bandwidth = load_sibling(__file__, "linear_bf16").read_bandwidth_gbps
    sides: dict[str, dict[str, Any]] = {}
    for name, path in (("this_tree", ours), ("baseline", baseline)):
        lib = ctypes.CDLL(path)
        layers = _bind(lib, fused._call.__name__)
        layers.argtypes, layers.restype = fused._call.argtypes, fused._call.restype
        heads = {}
        for wdtype, fn in kernels._linear.items():
            theirs = _bind(lib, fn.__name__)
            theirs.argtypes, theirs.restype = fn.argtypes, fn.restype
            heads[wdtype] = theirs
        sides[name] = {"path": path, "layers": layers, "heads": heads, **{k: [] for k in TIMED}}
    current: list[dict] = []

    def timed(pick: Callable[[dict], Callable], key: str) -> Callable:
        def call(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return pick(current[0])(*args)
            finally:
                current[0][key][-1].append(time.perf_counter() - start)

        return call

    engine = llm.llm_engine
    saved_call, saved_linear, saved_step = fused._call, dict(kernels._linear), engine.step
    fused._call = timed(lambda side: side["layers"], "c")
    engine.step = timed(lambda side: saved_step, "step")
    for wdtype in saved_linear:
        kernels._linear[wdtype] = timed(lambda side, w=wdtype: side["heads"][w], "head")
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)

    def generate_on(side: dict) -> None:  # one generate, its steps timed as a round of side's
        current[:] = [side]
        for key in TIMED:
            side[key].append([])
        llm.generate(PROMPT, params, use_tqdm=False)

    gbps = []
    try:
        for side in sides.values():  # warm-up: each library's first call, not kept
            generate_on(side)
            for key in TIMED:
                side[key].clear()
        first = round(bandwidth(), 1)  # round i ran between samples i - 1 (this one) and i
        for _ in range(rounds):
            for side in sides.values():
                generate_on(side)
            gbps.append(round(bandwidth(), 1))
    finally:
        fused._call, engine.step = saved_call, saved_step
        kernels._linear.clear()
        kernels._linear.update(saved_linear)
        llm.shutdown()
    result: dict[str, Any] = {"model": model, "dtype": dtype, "rounds": rounds, "tokens": tokens}
    result["threads"] = torch.get_num_threads()
    result["read_gbps"] = gbps
    for name, side in sides.items():
        result[name] = {"library": side["path"]}
    new, old = sides["this_tree"], sides["baseline"]
    for key, label in TIMED.items():
        # the first step of each generate is the prompt's: decode steps only
        steps = {n: [s for r in side[key] for s in r[1:]] for n, side in sides.items()}
        if not steps["this_tree"]:  # a head that is not a CpuLinear (GGUF blocks)
            continue
        for name in sides:
            result[name][f"{label}_ms"] = round(1e3 * statistics.median(steps[name]), 3)
        ratios = [a / b for ra, rb in zip(new[key], old[key], strict=True)
                  for a, b in zip(ra[1:], rb[1:], strict=True)]  # fmt: skip
        result[f"{label}_ratio"] = _quantiles(ratios)
    result["per_round"] = [
        _round(sides, i, before, after)
        for i, (before, after) in enumerate(zip([first, *gbps[:-1]], gbps, strict=True))
    ]
    return result


def _round(sides: dict[str, dict], i: int, before: float, after: float) -> dict:
    """Round i: the bandwidth sampled just before and just after it (where the two differ, the
    VM changed phase in between) and each side's medians over its decode steps (ms) of what
    TIMED names (a head that is not a CpuLinear: none)."""
    out: dict[str, float] = {"read_gbps_before": before, "read_gbps": after}
    for name, side in sides.items():
        for key, label in TIMED.items():
            if side[key][i][1:]:
                out[f"{name}_{label}_ms"] = round(1e3 * statistics.median(side[key][i][1:]), 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder or GGUF file")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--baseline-src", help="another checkout's src folder")
    parser.add_argument("--baseline-lib", help="or its built kernel library (.so) itself")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps a generate")
    args = parser.parse_args(argv)
    if bool(args.baseline_src) == bool(args.baseline_lib):
        parser.error("give one of --baseline-src and --baseline-lib")
    baseline = args.baseline_lib or baseline_library(args.baseline_src)
    result = run(args.model, args.dtype, baseline, max(1, args.rounds), max(1, args.tokens))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

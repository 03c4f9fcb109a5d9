"""Single-stream decode speed on a GGUF file: TPOT, CPU time a token, and one step's linears.

For comparing with `llama-bench -m FILE -p 0 -n 64 -t T` on the same file. Per activation pass
count (1: llama.cpp's arithmetic, 2: the default), after a warm-up, each repeat times a
1-token and an (n + 1)-token greedy `LLM.generate` (ignore_eos) and takes the difference / n:

    tpot_ms        wall time a token (min over repeats)
    cpu_ms         the process's CPU time a token, all threads (min over repeats): on a shared
                   machine wall time includes time the kernels waited for a core, CPU time
                   does not (with one thread it is the kernels' own cost)
    linears_ms     every QuantLinear of the model once on a random row, back to back (the
                   decode step's linears and the head; min over 3 x repeats), wall and CPU

Threads: torch's (set OMP_NUM_THREADS, or --threads).

    python benchmarks/gguf_decode.py --model SmolLM2-135M-Instruct.Q4_1.gguf --threads 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from conveyor import LLM, SamplingParams
from conveyor.model.cpu.quant_linear import QuantLinear

PROMPT = [[1, 415, 5565, 349, 264]]


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(model: str, passes: int, tokens: int, repeats: int, kv_blocks: int) -> dict:
    llm = LLM(model, num_kv_blocks=kv_blocks, dtype="float32", quant_activation_passes=passes)

    def gen(n: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(PROMPT, params, use_tqdm=False)

    gen(4)  # warm-up: the kernels' build, the first step's allocations
    tpot, cpu = [], []
    for _ in range(repeats):
        one, many = _timed(lambda: gen(1)), _timed(lambda: gen(tokens + 1))
        tpot.append((many[0] - one[0]) / tokens)
        cpu.append((many[1] - one[1]) / tokens)
    linears = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, QuantLinear)]
    xs = [torch.randn(1, m.in_features) for m in linears]

    def run_linears() -> None:
        for m, x in zip(linears, xs, strict=True):
            m(x)

    lin = [_timed(run_linears) for _ in range(3 * repeats)]
    llm.shutdown()
    return {
        "passes": passes,
        "tpot_ms": round(1e3 * min(tpot), 3),
        "cpu_ms": round(1e3 * min(cpu), 3),
        "quant_linears": len(linears),
        "linears_ms": round(1e3 * min(t for t, _ in lin), 3),
        "linears_cpu_ms": round(1e3 * min(c for _, c in lin), 3),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a .gguf file")
    parser.add_argument("--passes", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    parser.add_argument("--tokens", type=int, default=32, help="tokens per timed generate")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--kv-blocks", type=int, default=64)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "runs": [
            measure(args.model, p, args.tokens, args.repeats, args.kv_blocks) for p in args.passes
        ],
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

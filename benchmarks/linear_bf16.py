"""bfloat16 linears on CPU: our GEMM against what the libraries give, at decode and prefill rows.

Every linear of one decode step of a model shape (each layer's qkv, o, gate_up and down, and
the head), applied back to back to an [M, K] input for each --rows M, best of --repeats passes,
interleaved. Sides (each one that runs on this CPU; the others say why not):

  ours_f32        csrc/gemm.c with float32 panels (linear_backend "cpu", dtype float32),
                  the build's best path (-march=native: AVX-512 where the CPU has it)
  ours_bf16       the same on bfloat16 panels (dtype bfloat16): vdpbf16ps with x rounded to
                  bf16 where the CPU has AVX512-BF16, else the weights widened in registers
  ours_bf16_widened  the kernel that widens bf16 weights to float32 (x unrounded), same build
  ours_f32_avx2, ours_bf16_avx2  the AVX2 + FMA kernels (CONVEYOR_CPU_ISA=avx2: what a
                  Zen 3 runs, and this CPU before the AVX-512 paths)
  onednn_f32      oneDNN's prepacked float32 linear (linear_backend "onednn")
  onednn_bf16     oneDNN's prepacked bfloat16 linear, bf16 activations
                  (torch.ops.mkldnn._reorder_linear_weight; needs AVX512-BW/VL/DQ or
                  AVX-NE-CONVERT)
  torch_bf16      F.linear on bf16 weights and activations (MKL / oneDNN's own choice)
  compiled_bf16   torch.compile (inductor's CPU backend) of the same bf16 pass

The memory floor: bytes of the bf16 weights / this machine's read bandwidth (the sum of a
large tensor, measured in the same run). stdout: one JSON object with each side's ms per
rows count, the ratios to ours_bf16, and ours_bf16's ratio to the floor. --layers keeps
that many decoder layers (and the head) for the prefill sizes of a large shape.

    python benchmarks/linear_bf16.py --shape smollm2-135m --rows 1 4 16 64 256 1024
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from collections.abc import Callable

import conveyor  # noqa: F401  (its OpenMP wait policy, set before torch loads libgomp)

# isort: split
import torch
import torch.nn.functional as F

from conveyor.model.cpu import cpu_build, cpu_kernels
from conveyor.model.cpu.huge_pages import arena_empty, huge_page_arena
from conveyor.model.cpu.linear import CpuLinear, PackedLinear

# (hidden, intermediate, layers, q heads, kv heads, head dim, vocab)
SHAPES = {
    "tiny": (64, 128, 2, 4, 2, 16, 256),
    "smollm2-135m": (576, 1536, 30, 9, 3, 64, 49152),
    "tinyllama-1.1b": (2048, 5632, 22, 32, 4, 64, 49152),
}


def linear_shapes(name: str, layers: int | None = None) -> list[tuple[int, int]]:
    """(out, in) of every linear of one decode step (of its first `layers` layers)."""
    h, inter, n_layers, hq, hkv, d, vocab = SHAPES[name]
    layer = [((hq + 2 * hkv) * d, h), (h, hq * d), (2 * inter, h), (h, inter)]
    return layer * (n_layers if layers is None else min(layers, n_layers)) + [(vocab, h)]


def kernels_for(isa: str) -> cpu_kernels.CpuKernels | str:
    """The C kernels built for CONVEYOR_CPU_ISA=`isa` (a library of their own beside the
    default one), or why not."""
    saved = os.environ.get(cpu_build.ISA_ENV)
    os.environ[cpu_build.ISA_ENV] = isa
    try:
        path = str(cpu_build.build())
        return cpu_kernels.CpuKernels(ctypes.CDLL(path), path)
    except (OSError, RuntimeError, ValueError) as exc:
        return f"no {isa} build here: {str(exc).splitlines()[0]}"
    finally:
        if saved is None:
            del os.environ[cpu_build.ISA_ENV]
        else:
            os.environ[cpu_build.ISA_ENV] = saved


def read_bandwidth_gbps() -> float:
    """Read bandwidth: the bytes of a 512 MiB tensor / the seconds of its sum (reads only,
    on torch's threads), best of three. The tensor is on 2 MiB pages where the kernel gives
    them, as the loaded weights are (conveyor/model/cpu/huge_pages.py): on this machine's
    4 KiB pages the sum often reads at half the speed (measured 2026-12-03: 43-53 GB/s
    against 79-85)."""
    with huge_page_arena():
        src = arena_empty((128 << 20,), torch.float32)
    src.fill_(1.0)
    best = min(_timed(src.sum) for _ in range(3))
    return src.numel() * 4 / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def sides(weights: list[torch.Tensor]) -> dict[str, Callable | str]:
    """Each side's pass maker (rows -> a function running every linear once), or why it
    cannot run here."""
    kernels = cpu_kernels.load()
    out: dict[str, Callable | str] = {}

    def chain(mods, dtype):
        def make(rows):
            xs = [torch.randn(rows, w.shape[1]).to(dtype) for w in weights]
            return lambda: [m(x) for m, x in zip(mods, xs, strict=True)]

        return make

    if kernels is None:
        for name in ("ours_f32", "ours_bf16", "ours_bf16_widened"):
            out[name] = "no C kernels (no compiler)"
    else:
        for name, dtype in (("ours_f32", torch.float32), ("ours_bf16", torch.bfloat16)):
            out[name] = chain([CpuLinear(w, None, kernels, dtype) for w in weights], torch.float32)
        if kernels.linear_isa == "avx512-bf16":
            mods = [CpuLinear(w, None, kernels, torch.bfloat16) for w in weights]
            out["ours_bf16_widened"] = chain(
                [
                    lambda x, m=m: kernels.linear(x, m.packed_weight, m.out_features, None, True)
                    for m in mods
                ],
                torch.float32,
            )
        else:
            out["ours_bf16_widened"] = f"the same kernel as ours_bf16 ({kernels.linear_isa})"
    avx2 = kernels_for("avx2") if kernels is not None else "no C kernels (no compiler)"
    for name, dtype in (("ours_f32_avx2", torch.float32), ("ours_bf16_avx2", torch.bfloat16)):
        if isinstance(avx2, str):
            out[name] = avx2
        else:
            out[name] = chain([CpuLinear(w, None, avx2, dtype) for w in weights], torch.float32)
    out["onednn_f32"] = chain([PackedLinear(w, None) for w in weights], torch.float32)
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16) for w in weights]
        out["onednn_bf16"] = chain(
            [
                lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                for p in packed
            ],
            torch.bfloat16,
        )
    except RuntimeError as exc:
        out["onednn_bf16"] = str(exc).splitlines()[0]
    bf16 = [w.bfloat16() for w in weights]
    out["torch_bf16"] = chain([lambda x, w=w: F.linear(x, w) for w in bf16], torch.bfloat16)

    def compiled(rows):
        xs = [torch.randn(rows, w.shape[1]).bfloat16() for w in bf16]
        fn = torch.compile(lambda xs: [F.linear(x, w) for x, w in zip(xs, bf16, strict=True)])
        fn(xs)  # compile
        return lambda: fn(xs)

    out["compiled_bf16"] = compiled
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: all)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-compile", action="store_true", help="leave torch.compile out")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for n, k in linear_shapes(args.shape, args.layers)]
    weight_bytes_bf16 = sum(w.numel() * 2 for w in weights)
    made = sides(weights)
    if args.skip_compile:
        made["compiled_bf16"] = "left out (--skip-compile)"
    kernels = cpu_kernels.load()
    report: dict = {
        "shape": args.shape,
        "layers": len(weights) // 4,
        "our_gemm": None if kernels is None else kernels.linear_isa,
        "torch_threads": torch.get_num_threads(),
        "weight_mib_bf16": round(weight_bytes_bf16 / 2**20, 1),
        "unavailable": {k: v for k, v in made.items() if isinstance(v, str)},
        "results": [],
    }
    bandwidth = read_bandwidth_gbps()
    report["read_bandwidth_gbps"] = round(bandwidth, 1)
    floor_ms = weight_bytes_bf16 / bandwidth / 1e6
    report["memory_floor_ms_bf16"] = float(f"{floor_ms:.4g}")  # tiny shapes: < 0.01 ms
    runnable = {k: v for k, v in made.items() if not isinstance(v, str)}
    with torch.inference_mode():
        for rows in args.rows:
            passes = {name: make(rows) for name, make in runnable.items()}
            best = dict.fromkeys(passes, float("inf"))
            for _ in range(args.repeats):  # interleaved
                for name, run in passes.items():
                    best[name] = min(best[name], _timed(run))
            entry = {"rows": rows, **{k: round(v * 1e3, 4) for k, v in best.items()}}
            if "ours_bf16" in best:
                entry["ratio_to_ours_bf16"] = {
                    k: round(v / best["ours_bf16"], 2) for k, v in best.items() if k != "ours_bf16"
                }
            if "ours_bf16" in best:
                entry["ours_bf16_over_floor"] = round(best["ours_bf16"] * 1e3 / floor_ms, 2)
            report["results"].append(entry)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

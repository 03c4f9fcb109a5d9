"""Compile conveyor's Triton kernels for a CUDA GPU (sm_90: H100/H200) on a machine without one.

Each launcher is called with CPU tensors of a few representative shapes; its kernel launch is
intercepted, and the exact arguments it would have passed go through Triton's whole CUDA
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas Triton ships). That catches
what the interpreter cannot: code-generator errors, ops or layouts a GPU lacks, and register
spills (ptxas -v). It says nothing about speed or results: that needs a GPU.

    python tests/kernels/kernel_compile.py [--arch 90]      # TRITON_INTERPRET must be unset
Prints one JSON line per kernel configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_PTR = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int8: "*i8",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


class _Capture:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _compile(fn, args, kwargs, arch: int) -> dict:
    sig, consts = {}, {}
    for i, param in enumerate(fn.params):
        value = args[i] if i < len(args) else kwargs[param.name]
        if param.is_constexpr:
            sig[param.name], consts[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[param.name] = _PTR[value.dtype]
        elif isinstance(value, float):
            sig[param.name] = "fp32"
        else:
            sig[param.name] = "i64" if abs(value) >= 2**31 else "i32"
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        report = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name={gpu}", str(ptx), "-o", str(ptx.with_suffix(".o"))],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    shown = ("GROUP", "HEAD_DIM", "BLOCK_M", "TILE_N", "NUM_SPLITS", "QUANT", "BLOCK_SIZE")
    shown += ("WINDOW", "BLOCK", "HAS_RES", "HALF")
    return {
        "kernel": fn.__name__,
        **{k: v for k, v in consts.items() if k in shown},
        "num_warps": options.get("num_warps"),
        "registers": int(re.search(r"Used (\d+) registers", report).group(1)),
        "spill_bytes": int(re.search(r"(\d+) bytes spill stores", report).group(1)),
    }


def _attention_cases():
    """(dtype, head size, GQA ratio, block size, int8, num_splits, mixed, sliding window) per
    configuration."""
    yield torch.bfloat16, 128, 4, 16, False, 1, False, None  # Llama-8B decode
    yield torch.bfloat16, 128, 4, 16, False, 4, False, None  # ... split keys (+ reduce kernel)
    yield torch.bfloat16, 128, 4, 16, False, 1, True, None  # Llama-8B mixed prefill/decode
    yield torch.bfloat16, 128, 4, 16, True, 1, False, None  # int8 cache decode
    yield torch.bfloat16, 128, 4, 16, True, 2, True, None  # int8 cache mixed, split
    yield torch.float16, 96, 8, 32, False, 1, True, None  # padded head size, block 32
    yield torch.float16, 64, 1, 16, False, 1, False, None  # MHA
    yield torch.float32, 64, 4, 16, False, 1, True, None  # fp32 mixed
    yield torch.bfloat16, 128, 4, 16, False, 2, False, 32  # Mistral-style window, decode split
    yield torch.bfloat16, 128, 4, 16, False, 1, True, 32  # ... mixed prefill/decode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90)
    arch = p.parse_args().arch
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    import conveyor.kernels.attention as attention
    import conveyor.kernels.fused as fused
    import conveyor.kernels.fused_moe as fused_moe
    import conveyor.kernels.kv_write as kv_write

    kernels = [
        (attention, "_paged_attention_kernel"),
        (attention, "_reduce_splits_kernel"),
        (kv_write, "_write_kv_kernel"),
        (fused, "_rms_norm_kernel"),
        (fused, "_rotary_kernel"),
        (fused, "_silu_mul_kernel"),
        (fused_moe, "_grouped_gemm_kernel"),
    ]
    for module, name in kernels:
        setattr(module, name, _Capture(getattr(module, name)))
    for dtype, d, group, bs, quant, splits, mixed, window in _attention_cases():
        hkv, q_lens = 2, [1, 1, 1] + ([40] if mixed else [])
        seq_lens = [50, 17, 64] + ([90] if mixed else [])
        cache = torch.zeros(2, 32, bs, hkv, d, dtype=torch.int8 if quant else dtype)
        scales = torch.zeros(2, 32, bs, hkv) if quant else None
        q = torch.zeros(sum(q_lens), group * hkv, d, dtype=dtype)
        tables = torch.zeros(len(q_lens), 8, dtype=torch.int32)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        attention.paged_attention(
            q, cache, tables, lens, qsl, 0.1, max(q_lens), max(seq_lens), scales, splits, window
        )
        kv_write.write_kv(q[:, :hkv], q[:, :hkv], cache, torch.zeros(len(q), dtype=torch.int64),
                          scales)  # fmt: skip
    for dtype in (torch.bfloat16, torch.float32):  # Qwen2.5-0.5B's widths
        x, w = torch.zeros(3, 896, dtype=dtype), torch.ones(896, dtype=dtype)
        fused.rms_norm(x, w, 1e-6)
        fused.add_rms_norm_(x, x.clone(), w, 1e-6)
        heads = torch.zeros(3, 18, 64, dtype=dtype)
        fused.rotary_step(torch.zeros(3, dtype=torch.long), torch.zeros(64, 64, dtype=dtype))(
            heads[:, :16]
        )
        fused.silu_mul(torch.zeros(3, 2 * 4864, dtype=dtype))
        # Qwen3-30B-A3B's widths (hidden 2048, expert 768), 4 of its experts, top-2
        x, ids = torch.zeros(5, 2048, dtype=dtype), torch.tensor([[0, 1], [2, 3]] * 2 + [[1, 2]])
        w13, w2 = torch.zeros(4, 1536, 2048, dtype=dtype), torch.zeros(4, 2048, 768, dtype=dtype)
        fused_moe.fused_moe(x, w13, w2, torch.ones(5, 2), ids)
    seen = set()
    for module, name in kernels:
        capture = getattr(module, name)
        for args, kwargs in capture.calls:
            key = repr([_kind(a) for a in args] + sorted((k, _kind(v)) for k, v in kwargs.items()))
            if key not in seen:
                seen.add(key)
                print(json.dumps(_compile(capture.fn, args, kwargs, arch)), flush=True)
    return 0


def _kind(value):
    """What a compiled kernel is specialised on (dtype for tensors, value otherwise)."""
    return str(value.dtype) if isinstance(value, torch.Tensor) else value


if __name__ == "__main__":
    sys.exit(main())

"""The Triton kernels compile for an H100/H200 (sm_90) without spilling, checked without a GPU.

tests/kernel_compile.py runs in a subprocess with TRITON_INTERPRET unset (this session's
kernels are interpreted): it intercepts each launcher's kernel call and compiles the exact
arguments through Triton's CUDA pipeline and ptxas.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_sm90_without_register_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kernel_compile.py"), "--arch", "90"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    configs = [json.loads(line) for line in run.stdout.splitlines()]
    kernels = {c["kernel"] for c in configs}
    assert kernels == {"_paged_attention_kernel", "_reduce_splits_kernel", "_write_kv_kernel"}
    assert len(configs) >= 10
    spilling = [c for c in configs if c["spill_bytes"]]
    assert not spilling, spilling

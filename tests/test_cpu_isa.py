"""The C kernels built for the portable instruction set (CONVEYOR_CPU_ISA=portable: what a CPU
without AVX2 builds, and aarch64's plain C paths) pass the kernel, linear and parity tests on
this machine, in a pytest of their own: the setting is read once per process, at the first
build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The kernels against torch, the linears (the portable GEMM, and auto picking oneDNN), and one
# family's exact greedy parity with transformers through the whole model.
PORTABLE_TESTS = [
    "tests/test_cpu_kernels.py",
    "tests/test_linear.py",
    "tests/test_cpu_build.py",
    "tests/test_parity.py::test_greedy_parity_with_ample_kv[llama]",
]


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_the_portable_build_passes_the_kernel_linear_and_parity_tests():
    env = {**os.environ, "CONVEYOR_CPU_ISA": "portable"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *PORTABLE_TESTS]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary[0] and "skipped" not in summary[0], summary[0]

"""The C kernels built for a lower instruction set than this CPU's (CONVEYOR_CPU_ISA=portable:
what a CPU without AVX2 builds, and aarch64's plain C paths; avx2: a Zen 3; avx512: AVX-512
without AVX512-BF16, a Skylake-X or Ice Lake; avx512bf16: the vdpbf16ps GEMM, what a native
build on this CPU may already be) pass the kernel, linear and parity tests on this machine,
in a pytest of their own: the setting is read once per process, at the first build. A level
this CPU lacks is skipped, with the features it misses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.model.cpu import cpu_build

ROOT = Path(__file__).resolve().parents[2]

# portable: the kernels against torch, the linears (the portable GEMM, and auto picking
# oneDNN), the quantized GGUF linears' plain C dot products, and one family's exact greedy
# parity with transformers through the whole model. avx2: the AVX2 paths without AVX-512
# (the quantized dot products' 256-bit maddubs), as on a Zen 3. avx512 and avx512bf16: the
# zmm GEMM with bf16 weights widened, and with vdpbf16ps (also a long GGUF prefill's GEMM on
# dequantized bf16 panels); the quantized dot products' 512-bit
# maddubs (x86-64-v4 has no VNNI; a native build on an AVX-512 VNNI CPU takes the 512-bit
# dpbusd paths in every other test); the decoder layers fused in one C call (one OpenMP
# region, every kernel's team form) stay bit for bit the modules' on each.
ISA_TESTS = {
    "portable": [
        "tests/model/test_cpu_kernels.py",
        "tests/model/test_linear.py",
        "tests/model/test_quant_linear.py",
        "tests/model/test_fused_layers.py",
        "tests/model/test_parity.py::test_greedy_parity_with_ample_kv[llama]",
    ],
    "avx2": [
        "tests/model/test_quant_linear.py",
        "tests/model/test_linear.py",
        "tests/model/test_fused_layers.py",
    ],
    "avx512": [
        "tests/model/test_linear.py",
        "tests/model/test_fused_layers.py",
        "tests/model/test_quant_linear.py",
    ],
    "avx512bf16": [
        "tests/model/test_linear.py",
        "tests/model/test_fused_layers.py",
        "tests/model/test_quant_linear.py",
    ],
}


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
@pytest.mark.parametrize("isa", sorted(ISA_TESTS))
def test_a_lower_instruction_set_passes_the_kernel_linear_and_parity_tests(isa):
    if isa != "portable":
        try:
            cpu_build.isa_flags(isa)
        except ValueError as exc:  # what this CPU lacks
            pytest.skip(str(exc))
    env = {**os.environ, "CONVEYOR_CPU_ISA": isa}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *ISA_TESTS[isa]]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary[0] and "skipped" not in summary[0], summary[0]

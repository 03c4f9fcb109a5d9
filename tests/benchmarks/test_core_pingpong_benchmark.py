"""benchmarks/core_pingpong.c builds with the C compiler the kernels use and reports where the
machine put two threads: a round trip, fork/join, barrier and the read bandwidth."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conveyor.model.cpu import cpu_build

pytestmark = pytest.mark.slow  # runs a benchmark script

SOURCE = Path(__file__).resolve().parents[2] / "benchmarks" / "core_pingpong.c"


def test_core_pingpong_builds_and_reports_json(tmp_path):
    try:
        cc = cpu_build.compiler()  # $CC, else cc or gcc: the kernels' own choice
    except RuntimeError:
        pytest.skip("no C compiler here")
    exe = tmp_path / "core_pingpong"
    subprocess.run([*cc, "-O2", "-fopenmp", str(SOURCE), "-o", str(exe)], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    # few rounds and a small buffer: a test on a loaded machine, not a measurement
    out = subprocess.run(
        [str(exe), "2000", "16"], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    got = json.loads(out.stdout)
    assert set(got) == {"pingpong_ns", "fork_join_us", "barrier_us", "read_gbps"}
    assert all(v > 0 for v in got.values())
    bad = subprocess.run([str(exe), "0"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr

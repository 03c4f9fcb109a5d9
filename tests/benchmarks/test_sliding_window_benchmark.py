"""benchmarks/sliding_window.py runs end to end on a tiny shape and its numbers are sound."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a benchmark script

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "sw_bench", ROOT / "benchmarks" / "sliding_window.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_sliding_window_benchmark_reports_each_window_against_full_attention(tmp_path, backend):
    out = tmp_path / "sw.json"
    _benchmark().main(
        ["--backend", backend, "--batch", "2", "--context", "200", "--windows", "16", "64",
         "--q-heads", "4", "--kv-heads", "2", "--head-size", "32", "--repeats", "1",
         "--out", str(out)]
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert [c["window"] for c in report["cases"]] == [None, 16, 64]
    for c in report["cases"]:
        assert c["step_ms"] > 0
        assert c["max_abs_diff_vs_dense"] < 1e-5  # each window's output is the masked softmax
    assert all(c["speedup_vs_full"] > 0 for c in report["cases"][1:])

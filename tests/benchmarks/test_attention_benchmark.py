"""benchmarks/attention.py runs end to end (on CPU: one tiny shape, interpreted Triton)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a benchmark script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.interpreter
def test_attention_benchmark_runs_and_reports_json(tmp_path):
    out = tmp_path / "attention.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--quick", "--out", str(out)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert [r["kind"] for r in report["results"]] == ["decode", "mixed"]
    tolerance = 1e-3 if report["dtype"] == "float32" else 3e-2  # CPU: fp32; CUDA: bf16
    for r in report["results"]:
        assert r["kernel_ms"] > 0 and r["sdpa_gathered_ms"] > 0
        assert r["max_abs_diff_vs_sdpa"] < tolerance  # the kernel and SDPA agree
    if report["device"] == "cpu":
        assert report["kernel"] in ("triton-interpreter", "torch")
    else:
        assert report["peak_bandwidth_GBps"] > 0 and report["results"][0]["ratio_to_peak"] > 0

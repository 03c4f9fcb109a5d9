"""benchmarks/linear_bf16.py runs end to end on a tiny shape (speed is not checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.load_client.sibling import load_sibling

pytestmark = pytest.mark.slow  # runs a benchmark script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
bench = load_sibling(str(BENCHMARKS / "linear_bf16.py"), "linear_bf16")


def test_linear_bf16_benchmark_times_every_side_that_runs_here(kernels, capsys):
    report = bench.main(["--shape", "tiny", "--rows", "1", "3", "--repeats", "1", "--skip-compile"])
    assert json.loads(capsys.readouterr().out) == report
    assert report["read_bandwidth_gbps"] > 0 and report["memory_floor_ms_bf16"] > 0
    assert "compiled_bf16" in report["unavailable"]
    for entry in report["results"]:
        for side in ("ours_f32", "ours_bf16", "onednn_f32", "torch_bf16"):
            assert entry[side] > 0
        ratio = entry["ratio_to_ours_bf16"]["ours_f32"]  # of the unrounded times
        assert ratio == pytest.approx(entry["ours_f32"] / entry["ours_bf16"], rel=0.02, abs=0.01)
    # oneDNN's bf16 linear either ran or says why not (the CPU features it needs)
    assert ("onednn_bf16" in report["results"][0]) != ("onednn_bf16" in report["unavailable"])

"""benchmarks/prefill_attacks.py runs end to end on a tiny workload (speed is not checked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a benchmark script

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_attacks.py"
_SPEC = importlib.util.spec_from_file_location("bench_prefill_attacks", _PATH)
prefill_attacks = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(prefill_attacks)


def test_the_benchmark_reports_the_steady_client_beside_each_attack(demo_model_dir, capsys):
    report = prefill_attacks.main(
        ["--model", str(demo_model_dir), "--unloaded", "3", "--embedding-inputs", "3",
         "--prompts", "2", "--input-tokens", "300", "--long-tokens", "900",
         "--sample-requests", "2", "--n", "2", "--sample-tokens", "4", "--logprobs", "2",
         "--pause", "0", "--max-client-sequences", "8"]
    )  # fmt: skip
    assert json.loads(capsys.readouterr().out) == report
    unloaded = report["steady_unloaded"]
    assert unloaded["n"] == 3 and 0 < unloaded["p50_s"] <= unloaded["max_s"]
    assert list(report["attacks"]) == ["embeddings", "prompts", "long-prompt", "samples"]
    for name, result in report["attacks"].items():
        assert set(result["statuses"]) == {200}, name
        assert result["attack_s"] > 0
        steady = result["steady"]
        if steady["n"]:  # (rounded: 4 decimals of seconds, 2 of the ratio)
            ratio = steady["p50_s"] / unloaded["p50_s"]
            assert steady["p50_x"] == pytest.approx(ratio, rel=0.03, abs=0.01)
            assert steady["p50_s"] <= steady["max_s"]
    assert report["steady_errors"] == []
    assert report["server_args"] == ["--max-client-sequences", "8"]

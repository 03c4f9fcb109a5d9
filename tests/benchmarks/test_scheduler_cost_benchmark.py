"""The scheduler-cost benchmark runs end to end (tiny sizes; speed is not checked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a benchmark script

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler_cost.py"
_SPEC = importlib.util.spec_from_file_location("bench_scheduler_cost", _PATH)
scheduler_cost = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(scheduler_cost)


def test_scheduler_cost_benchmark_prints_every_policy_and_size(capsys):
    result = scheduler_cost.main(["--sizes", "5", "40", "--steps", "5", "--repeats", "2"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == result
    policies = set(scheduler_cost.available_policies())
    for field in ("us_per_step", "mean_us_per_step"):
        assert set(result[field]) == policies
        for per_size in result[field].values():
            assert set(per_size) == {"5", "40"}
            assert all(v > 0 for v in per_size.values())
    assert set(result["ratio_largest_to_smallest"]) == policies

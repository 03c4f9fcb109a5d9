"""The throughput benchmark script runs end to end (a tiny workload; speed is not checked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a benchmark script

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"
_SPEC = importlib.util.spec_from_file_location("bench_throughput", _PATH)
throughput = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(throughput)


def test_throughput_benchmark_prints_both_sides_and_their_ratio(demo_model_dir, capsys):
    result = throughput.main(
        [
            "--model", str(demo_model_dir),
            "--num-requests", "4",
            "--batch-size", "2",
            "--min-prompt", "20",
            "--max-prompt", "40",
            "--mean-output", "3",
            "--repeats", "2",
        ]
    )  # fmt: skip
    printed = json.loads(capsys.readouterr().out)
    assert printed == result
    for side in ("conveyor", "transformers_static"):
        assert result[side]["requests"] == 4
        assert result[side]["output_tokens"] == result["conveyor"]["output_tokens"]
        assert result[side]["output_tokens_per_s"] > 0
    expected = (
        result["conveyor"]["output_tokens_per_s"]
        / result["transformers_static"]["output_tokens_per_s"]
    )
    assert abs(result["ratio_output_tokens_per_s"] - expected) < 0.01
    # Fresh prompt ids every repeat (at least one full block each): no prefix-cache hits.
    assert result["conveyor"]["prompt_tokens_from_cache"] == [0, 0]


def test_throughput_benchmark_compares_the_linear_backends(demo_model_dir, capsys):
    result = throughput.main(
        [
            "--model", str(demo_model_dir), "--num-requests", "4", "--batch-size", "2",
            "--min-prompt", "4", "--max-prompt", "8", "--mean-output", "3", "--repeats", "1",
            "--skip-transformers", "--compare-linear-torch", "--disable-tqdm",
        ]
    )  # fmt: skip
    assert json.loads(capsys.readouterr().out) == result
    assert "transformers_static" not in result
    same = result["conveyor_linear_torch"]["output_tokens"] == result["conveyor"]["output_tokens"]
    assert same
    expected = (
        result["conveyor"]["output_tokens_per_s"]
        / result["conveyor_linear_torch"]["output_tokens_per_s"]
    )
    assert abs(result["ratio_default_to_linear_torch"] - expected) < 0.01

"""The structured-outputs benchmark runs end to end on a tiny workload (speed is not checked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a benchmark script

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "structured_outputs.py"
_SPEC = importlib.util.spec_from_file_location("bench_structured_outputs", _PATH)
structured_outputs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(structured_outputs)


def test_structured_outputs_benchmark_reports_both_sides_and_the_grammar_cache(
    demo_model_dir, capsys
):
    result = structured_outputs.main(
        ["--model", str(demo_model_dir), "--num-requests", "4", "--num-schemas", "2",
         "--prompt-tokens", "8", "--max-tokens", "128", "--max-items", "1", "--repeats", "1"]
    )  # fmt: skip
    assert json.loads(capsys.readouterr().out) == result
    js, free = result["json_schema"], result["unconstrained"]
    assert js["output_tokens"] == free["output_tokens"] > 0
    assert js["output_tokens_per_s"] > 0 and free["output_tokens_per_s"] > 0
    expected = js["output_tokens_per_s"] / free["output_tokens_per_s"]
    assert result["json_over_unconstrained_tok_s"] == pytest.approx(expected)
    assert result["constrained_finished_stop"] == 4  # every schema's output completed
    grammar = result["grammar"]
    assert grammar["compiles"] == 2 and grammar["compile_time_s"] > 0
    assert grammar["cache_queries"] == 4 and grammar["cache_hits"] == 2
    assert grammar["cache_hit_rate"] == pytest.approx(2 / 4)
    assert isinstance(result["targets"]["at_most_10pct_slower"], bool)


def test_more_schemas_than_requests_is_a_clear_error_exit(capsys):
    with pytest.raises(SystemExit) as exc:
        structured_outputs.main(["--num-requests", "2", "--num-schemas", "3"])
    assert exc.value.code == 2
    assert "--num-schemas" in capsys.readouterr().err

"""The prefix-caching benchmark runs end to end on a tiny workload (speed is not checked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a benchmark script

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "prefix_caching.py"
_SPEC = importlib.util.spec_from_file_location("bench_prefix_caching", _PATH)
prefix_caching = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(prefix_caching)

_SIDE_KEYS = {
    "requests", "output_tokens", "seconds", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
    "prefix_cache_hit_rate", "prefix_cache_hit_tokens", "preemptions", "all_seconds",
}  # fmt: skip


def test_prefix_caching_benchmark_reports_both_workloads_sides_and_n_samples(
    demo_model_dir, capsys
):
    result = prefix_caching.main(
        [
            "--model", str(demo_model_dir), "--conversations", "4", "--turns", "2",
            "--system-tokens", "64", "--user-tokens", "8", "24", "--output-tokens", "4",
            "--n", "4", "--n-prompt-tokens", "64", "--repeats", "1",
        ]
    )  # fmt: skip
    assert json.loads(capsys.readouterr().out) == result
    assert result["workload"]["conversations"] == 4 and result["workload"]["turns"] == 2
    for workload in ("multi_turn", "no_shared"):
        for side in ("caching_on", "caching_off"):
            r = result[workload][side]
            assert set(r) == _SIDE_KEYS
            assert r["requests"] == 8 and r["output_tokens"] == 8 * 4
            assert r["output_tokens_per_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
            assert r["preemptions"] == 0
        assert result[workload]["caching_off"]["prefix_cache_hit_rate"] == 0
        ratios = result["ratios"][workload]
        on, off = result[workload]["caching_on"], result[workload]["caching_off"]
        expected = on["output_tokens_per_s"] / off["output_tokens_per_s"]
        assert ratios["throughput_on_over_off"] == pytest.approx(expected, rel=0.01)
        assert ratios["ttft_p50_off_over_on"] > 0
    # The system prompt's 4 full blocks: hit by all but the first request of turn 1, and by
    # every request of turn 2 (which hits its own history too).
    multi_on = result["multi_turn"]["caching_on"]
    assert 0 < multi_on["prefix_cache_hit_rate"] < 1
    assert multi_on["prefix_cache_hit_tokens"] >= (3 + 4) * 64
    assert result["no_shared"]["caching_on"]["prefix_cache_hit_rate"] == 0

    samples = result["n_samples"]
    for key in ("n_caching_on", "n_caching_off", "separate_caching_off"):
        assert samples[key]["sequences"] == 4 and samples[key]["output_tokens"] == 4 * 16
    assert samples["separate_caching_off"]["requests"] == 4
    assert samples["n_caching_off"]["prefill_tokens_computed"] == 4 * 64
    # One sample computes the prompt; the others only the block that holds its last token.
    assert samples["n_caching_on"]["prefill_tokens_computed"] == 64 + 3 * 16
    assert samples["prefill_tokens_n_on_over_separate_off"] == pytest.approx(112 / 256, abs=1e-3)
    assert set(result["targets"]) == {
        "multi_turn_throughput_2x", "multi_turn_ttft_p50_3x_lower", "no_shared_at_most_3pct_slower",
    }  # fmt: skip
    assert all(isinstance(v, bool) for v in result["targets"].values())


def test_bad_user_token_range_is_a_clear_error_exit(capsys):
    with pytest.raises(SystemExit) as exc:
        prefix_caching.main(["--user-tokens", "9", "3"])
    assert exc.value.code == 2
    assert "--user-tokens" in capsys.readouterr().err

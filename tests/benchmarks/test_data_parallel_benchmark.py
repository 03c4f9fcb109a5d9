"""The data-parallel benchmark runs end to end on a tiny workload (speed is not checked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a benchmark script

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "data_parallel.py"
_SPEC = importlib.util.spec_from_file_location("bench_data_parallel", _PATH)
data_parallel = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(data_parallel)


@pytest.mark.slow  # three engine processes start (DP 1 and DP 2 side by side)
def test_data_parallel_benchmark_reports_each_size_and_both_replicas_work(capsys):
    argv = ["--shape", "tiny3", "--num-prompts", "8", "--input-len", "6", "--output-len", "3"]
    argv += ["--rounds", "1", "--max-num-seqs", "8", "--num-kv-blocks", "32", "--disable-tqdm"]
    result = data_parallel.main(argv)
    assert json.loads(capsys.readouterr().out) == result
    one, two = result["data_parallel"]["1"], result["data_parallel"]["2"]
    for size in (one, two):
        assert size["successful_requests_last_round"] == 8
        assert size["output_throughput_median"] > 0 and size["server_exit_code"] == 0
        assert size["last_round"]["total_output_tokens"] == 8 * 3
    assert one["speedup_over_first_size_median"] == 1.0
    expected = two["output_throughput_median"] / one["output_throughput_median"]
    assert abs(two["speedup_over_first_size_median"] - expected) < 0.01
    assert one["finished_per_replica_last_round"] == [8]
    # 8 equal requests at once: both replicas serve some (not always 4 / 4: a replica that
    # already streamed tokens has fewer outstanding when the last requests are routed).
    per_replica = two["finished_per_replica_last_round"]
    assert len(per_replica) == 2 and sum(per_replica) == 8 and min(per_replica) >= 2

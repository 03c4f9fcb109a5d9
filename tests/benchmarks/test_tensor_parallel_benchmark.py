"""The tensor-parallel benchmark runs end to end on a tiny workload (speed is not checked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.slow  # runs a benchmark script

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "tensor_parallel.py"
_SPEC = importlib.util.spec_from_file_location("bench_tensor_parallel", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

_TINY = [
    "--shape", "tiny3", "--num-requests", "4", "--batch-size", "2", "--min-prompt", "4",
    "--max-prompt", "8", "--mean-output", "3", "--max-output", "6", "--repeats", "1",
    "--disable-tqdm",
]  # fmt: skip


def test_tensor_parallel_benchmark_reports_each_size_and_the_collectives(capsys):
    result = bench.main(_TINY)
    assert json.loads(capsys.readouterr().out) == result
    total = result["workload"]["total_output_tokens"]
    for name in ("tp1_1thread", "tp1_threads", "tp2"):
        rate = total / result[name]["seconds"]  # seconds are kept to the microsecond
        assert result[name]["output_tokens_per_s"] == pytest.approx(rate, rel=0.05)
    assert result["tp2"]["threads_per_rank"] == 1
    comm = result["tp2_collectives"]
    # tiny3 has 3 layers: the embedding's all-reduce, two per layer, then a logits gather
    # in every step that samples (each step here samples at least one request).
    assert comm["steps"] > 0 and comm["collectives_per_step"] >= 1 + 2 * 3
    assert 0 < comm["collective_ms_per_step"] <= comm["step_ms"]
    assert not dist.is_initialized()  # the benchmark shut its group down

"""The load-memory benchmark runs end to end on a small checkpoint, and loading stays near one
copy of the weights (the 1.3x target; the small size leaves room for fixed overheads)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a benchmark script

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "load_memory.py"
_SPEC = importlib.util.spec_from_file_location("bench_load_memory", _PATH)
load_memory = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(load_memory)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_load_memory_benchmark_reports_each_case_within_the_target(capsys):
    result = load_memory.main(
        ["--hidden", "512", "--intermediate", "2048", "--layers", "2", "--heads", "8",
         "--kv-heads", "2", "--vocab", "8192", "--shards", "2"]
    )  # fmt: skip
    assert set(result) == {"checkpoint", "float32->float32", "bfloat16->bfloat16",
                           "bfloat16->float32"}  # fmt: skip
    for case in ("float32->float32", "bfloat16->bfloat16", "bfloat16->float32"):
        r = result[case]
        assert r["weights_mib"] > 20
        assert r["ratio"] < 1.3, (case, r)
        # Every weight read once: still about one copy (views of the file count once).
        assert r["rss_after_reading_every_weight_mib"] < 1.3 * r["weights_mib"], (case, r)
    assert '"bfloat16->float32"' in capsys.readouterr().out

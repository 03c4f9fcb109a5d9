"""benchmarks/prompt_logprobs_stall.py runs end to end on the demo model and reports each case."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a benchmark script

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    path = ROOT / "benchmarks" / "prompt_logprobs_stall.py"
    spec = importlib.util.spec_from_file_location("plp_stall_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stall_benchmark_reports_the_victims_gap_per_case(demo_model_dir, tmp_path) -> None:
    from conveyor.core import chunking

    out = tmp_path / "stall.json"
    _benchmark().main(
        ["--model", str(demo_model_dir), "--prompt-tokens", "600", "--repeats", "1",
         "--max-num-batched-tokens", "1024", "--out", str(out)]
    )  # fmt: skip
    report = json.loads(out.read_text())
    gaps = report["victim_max_gap_s"]
    assert set(gaps) == {
        "no_prompt_logprobs",
        "prompt_logprobs_unchunked",
        "prompt_logprobs_chunked",
    }
    assert all(g > 0 for g in gaps.values())
    assert report["chunk"] == chunking.PROMPT_LOGPROBS_CHUNK == 256  # restored after the run

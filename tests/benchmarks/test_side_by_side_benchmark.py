"""The side-by-side benchmark runs end to end on a tiny workload (speed is not checked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a benchmark script

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "side_by_side.py"
_SPEC = importlib.util.spec_from_file_location("bench_side_by_side", _PATH)
side_by_side = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(side_by_side)

_TINY = [
    "--shape", "tiny3", "--num-requests", "4", "--batch-size", "2", "--min-prompt", "20",
    "--max-prompt", "40", "--mean-output", "3", "--min-output", "2", "--max-output", "6",
    "--repeats", "2", "--split-steps", "3", "--disable-tqdm",
]  # fmt: skip


def test_side_by_side_prints_every_side_and_the_analyses(capsys):
    result = side_by_side.main(_TINY)
    assert json.loads(capsys.readouterr().out) == result
    assert result["model"] == "shape:tiny3" and result["attention_backend"] == "auto"
    assert result["vllm_cpu"] is None and result["ratio_conveyor_to_vllm"] is None
    # Fresh prompt ids every repeat and a warm-up of its own: nothing comes from the cache
    # (20 to 40 tokens: at least one full block of 16 each, which a reused prompt would hit).
    assert result["workload"]["fresh_prompt_ids_every_repeat"]
    assert result["conveyor"]["prompt_tokens_from_cache"] == [0, 0]
    assert result["transformers_static"]["prompt_tokens_from_cache"] == [None, None]
    total = result["workload"]["total_output_tokens"]
    for side in ("conveyor", "transformers_static"):
        assert result[side]["requests"] == 4
        assert result[side]["output_tokens"] == total
        assert result[side]["output_tokens_per_s"] > 0
    expected = (
        result["conveyor"]["output_tokens_per_s"]
        / result["transformers_static"]["output_tokens_per_s"]
    )
    assert abs(result["ratio_conveyor_to_transformers"] - expected) < 0.01
    floor = result["gemm_floor"]
    assert floor["num_linears"] == 3 * 4 + 1 and floor["batch"] == 2 and floor["seconds"] > 0
    split = result["step_split"]
    assert split["all_steps_were_pure_decode"] and split["steps"] == 3
    for key in ("step_ms", "forward_ms", "logits_ms", "execute_ms", "engine_overhead_fraction"):
        assert key in split
    assert 0 < split["forward_ms"] <= split["step_ms"]
    assert split["step_min_ms"] <= split["step_median_ms"]
    assert floor["ms"] <= floor["median_ms"]
    assert split["step_to_floor_best"] == pytest.approx(split["step_min_ms"] / floor["ms"], 1e-2)
    assert floor["repeats"] == 3 and split["step_to_floor_paired_median"] > 0  # one pass a step


def test_a_missing_vllm_python_is_a_clear_error_exit(tmp_path, capsys):
    missing = str(tmp_path / "no-such-python")
    with pytest.raises(SystemExit) as exc:
        side_by_side.main([*_TINY, "--vllm-python", missing])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--vllm-python" in err and "no such executable file" in err
    assert "Traceback" not in err

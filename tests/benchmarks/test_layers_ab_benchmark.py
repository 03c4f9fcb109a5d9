"""benchmarks/layers_ab.py runs end to end on the demo checkpoint: both kernel libraries loaded
in one process, swapped generate by generate, each side's steps timed and paired."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from conveyor.model.cpu import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location(
    "bench_layers_ab", ROOT / "benchmarks" / "layers_ab.py"
)
layers_ab = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(layers_ab)

pytestmark = [
    pytest.mark.slow,  # runs a benchmark script
    pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_sides_run_every_round_in_one_process(demo_model_dir, dtype, capsys):
    ours = cpu_kernels.load().path
    args = ["--model", str(demo_model_dir), "--dtype", dtype, "--rounds", "2", "--tokens", "3"]
    result = layers_ab.main([*args, "--baseline-lib", ours])
    assert len(result["read_gbps"]) == 2
    for side in ("this_tree", "baseline"):
        assert result[side]["library"] == ours
        assert result[side]["c_call_ms"] > 0 and result[side]["head_ms"] > 0
        # the whole step holds the C call and the head
        assert result[side]["step_ms"] > result[side]["c_call_ms"]
    assert [r["read_gbps"] for r in result["per_round"]] == result["read_gbps"]
    # a round's sample before it is the previous round's after it
    assert [r["read_gbps_before"] for r in result["per_round"]][1:] == result["read_gbps"][:-1]
    for r in result["per_round"]:
        for side in ("this_tree", "baseline"):
            assert r[f"{side}_step_ms"] > r[f"{side}_c_call_ms"] > 0 and r[f"{side}_head_ms"] > 0
    for key in ("c_call_ratio", "head_ratio", "step_ratio"):
        ratio = result[key]
        assert 0 < ratio["p10"] <= ratio["median"] <= ratio["p90"]
    assert '"c_call_ratio"' in capsys.readouterr().out


def test_a_baseline_checkout_is_built_in_a_subprocess():
    # this tree's own sources: the same cache key, so the library already built
    assert layers_ab.baseline_library(str(ROOT / "src")) == cpu_kernels.load().path


def test_one_baseline_is_required(demo_model_dir):
    with pytest.raises(SystemExit):
        layers_ab.main(["--model", str(demo_model_dir)])

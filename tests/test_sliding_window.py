"""Sliding-window models: never silently different from the model.

conveyor attends to the whole context, which equals sliding-window attention only within the
window, so the context of a model whose layers use a window is capped to it: inside it greedy
tokens equal transformers' (which applies the window), a longer request is refused with a
message that names the window. Which layers use a window follows each family's config.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tests.hf_checkpoints import write_checkpoint

from conveyor import LLM, SamplingParams
from conveyor.model.llama import ModelConfig

WINDOW = 16


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory, tiny_tokenizer_dir):
    path = tmp_path_factory.mktemp("mistral-window")
    return write_checkpoint(path, "mistral", tiny_tokenizer_dir, sliding_window=WINDOW)


def test_a_sliding_window_model_runs_like_transformers_within_the_window(mistral_window):
    llm = LLM(str(mistral_window), num_kv_blocks=32, block_size=8)
    assert llm.llm_engine.max_model_len == WINDOW
    hf = transformers.AutoModelForCausalLM.from_pretrained(mistral_window, dtype=torch.float32)
    assert hf.config.sliding_window == WINDOW
    prompts = [[3, 99, 7, 250, 18, 41, 5, 300, 12, 77], [8, 8, 150]]
    want = []
    for ids in prompts:  # prompt + output = the whole window
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=WINDOW - len(ids), min_new_tokens=WINDOW - len(ids),
            do_sample=False,
        )  # fmt: skip
        want.append(out[0, len(ids) :].tolist())
    params = [
        SamplingParams(temperature=0.0, max_tokens=WINDOW - len(p), ignore_eos=True)
        for p in prompts
    ]
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want


def test_a_request_longer_than_the_window_is_refused_naming_it(mistral_window):
    llm = LLM(str(mistral_window), num_kv_blocks=32, block_size=8)
    with pytest.raises(ValueError, match=r"maximum context length is 16 tokens \(the model's "
                       r"sliding-window size: conveyor attends to the whole context"):  # fmt: skip
        llm.generate([list(range(3, 23))], SamplingParams(max_tokens=4), use_tqdm=False)


def _window(**hf):
    base = dict(architectures=["X"], vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=4, num_attention_heads=2, sliding_window=WINDOW)  # fmt: skip
    return ModelConfig.from_hf_config({**base, **hf}).sliding_window


def test_which_configs_use_a_window():
    assert _window() == WINDOW  # Mistral: every layer
    assert _window(sliding_window=None) is None
    # Qwen2/3: behind use_sliding_window, from layer max_window_layers on.
    assert _window(use_sliding_window=False, max_window_layers=0) is None
    assert _window(use_sliding_window=True, max_window_layers=2) == WINDOW
    assert _window(use_sliding_window=True, max_window_layers=4) is None
    # transformers 5's per-layer list wins.
    full, sliding = "full_attention", "sliding_attention"
    assert _window(use_sliding_window=True, layer_types=[full] * 4) is None
    assert _window(layer_types=[full, sliding, full, full]) == WINDOW

"""RoPE scaling past the original context: greedy tokens equal transformers'.

Each type runs prompts that start inside the original context (32 positions here) and run
well past it, on a tiny Llama whose rope has that scaling. Dynamic NTK is refused: its
frequencies depend on the longest sequence in transformers' batch at each step.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from tests.hf_checkpoints import write_checkpoint

from conveyor import LLM, SamplingParams
from conveyor.model.llama import ModelConfig

ORIGINAL = 32
SCALINGS = {
    "linear": dict(rope_type="linear", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
    "yarn-betas-mscale": dict(
        rope_type="yarn",
        factor=8.0,
        original_max_position_embeddings=ORIGINAL,
        beta_fast=16.0,
        beta_slow=2.0,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
    "llama3": dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=ORIGINAL,
    ),
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rope_scaling_matches_transformers_past_the_original_context(
    name, tmp_path, tiny_tokenizer_dir
):
    rope = {"rope_theta": 10000.0, **SCALINGS[name]}
    path = write_checkpoint(
        tmp_path / name, "llama", tiny_tokenizer_dir, rope_parameters=rope,
        max_position_embeddings=4 * ORIGINAL * 2,
    )  # fmt: skip
    rng = random.Random(5)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (20, 45, 90)]
    max_tokens = 40  # the first prompt crosses position 32 while decoding
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = []
    for ids in prompts:
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
        )  # fmt: skip
        want.append(out[0, len(ids) :].tolist())
    llm = LLM(str(path), num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_dynamic_ntk_rope_is_refused_by_name():
    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=8,
              intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
              rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4))  # fmt: skip
    with pytest.raises(ValueError, match=r"Unsupported rope type 'dynamic'; supported: default"):
        ModelConfig.from_hf_config(hf)

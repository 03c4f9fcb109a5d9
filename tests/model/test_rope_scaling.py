"""RoPE scaling past the original context: greedy tokens equal transformers'.

Each type runs prompts that start inside the original context (32 positions here) and run
well past it, on a tiny Llama whose rope has that scaling. Dynamic NTK follows transformers
position by position (conveyor.model.models.layers.dynamic_ntk_inv_freq): exact for generated tokens
and prompts inside the original context, and independent of how a longer prompt is chunked.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from tests.hf_checkpoints import greedy_reference, write_checkpoint

from conveyor import LLM, SamplingParams
from conveyor.model.models.layers import RotaryEmbedding
from conveyor.model.models.llama import ModelConfig

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
    want = greedy_reference(hf, prompts, [max_tokens] * len(prompts), ignore_eos=True)
    llm = LLM(str(path), num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


DYNAMIC = {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 4.0}


@pytest.fixture(scope="module")
def dynamic_llama(tmp_path_factory, tiny_tokenizer_dir):
    # transformers' dynamic NTK reads max_position_embeddings as the original context.
    path = write_checkpoint(
        tmp_path_factory.mktemp("dynamic"), "llama", tiny_tokenizer_dir,
        rope_parameters=DYNAMIC, max_position_embeddings=ORIGINAL,
    )  # fmt: skip
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_dynamic_ntk_matches_transformers_past_the_original_context(dynamic_llama):
    """Prompts inside the original 32 positions decode to position ~90: every generated token
    is rotated with the base transformers recomputes for it (its position + 1), and cached
    keys keep the rotation they were written with, in both. conveyor batches the prompts and
    chunks them; transformers runs each alone (its base would follow the longest row)."""
    path, hf = dynamic_llama
    rng = random.Random(9)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (31, 12, 20)]
    max_tokens = 60
    want = greedy_reference(hf, prompts, [max_tokens] * len(prompts), ignore_eos=True)
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=8)
    assert llm.llm_engine.max_model_len == 4 * ORIGINAL  # factor x the original context
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_dynamic_ntk_table_row_is_transformers_rotation_at_that_length(dynamic_llama):
    _, hf = dynamic_llama
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, 10000.0,
                          config.rope_scaling)  # fmt: skip
    rotary = type(hf.model.rotary_emb)(hf.config)
    x = torch.zeros(1, 1, config.head_dim)
    for p in (0, ORIGINAL - 1, ORIGINAL, 77, 4 * ORIGINAL - 1):
        cos, sin = rotary(x, torch.arange(p + 1)[None])  # a forward whose last position is p
        half = config.head_dim // 2
        want = torch.cat((cos[0, -1, :half], sin[0, -1, :half]))
        # Equal up to the last bit of a vectorised float32 power (see dynamic_ntk_inv_freq).
        torch.testing.assert_close(emb.cos_sin_cache[p], want, atol=1e-6, rtol=0)
        if p < ORIGINAL:  # plain rope there: exactly transformers' initial frequencies
            torch.testing.assert_close(emb.cos_sin_cache[p], want, atol=0, rtol=0)


def test_dynamic_ntk_prompts_longer_than_the_original_context_do_not_depend_on_chunking(
    dynamic_llama,
):
    """Past the original context a prompt token's rotation follows its own position, so the
    answer is the same whatever the chunk size (transformers would rotate a whole prompt with
    the base of its length; see layers.dynamic_ntk_inv_freq)."""
    path, hf = dynamic_llama
    rng = random.Random(4)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (45, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = []
    for chunk in (2048, 7):
        llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=chunk)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]

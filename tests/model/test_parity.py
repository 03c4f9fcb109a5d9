"""Greedy tokens from LLM.generate equal transformers' own generate, token for token.

Every family runs >= 16 prompts of mixed lengths and max_tokens in ONE generate call, under
three engine settings: ample KV; a KV cache so small that requests are preempted; a token
budget so small that prompts are chunked. transformers runs one prompt at a time in float32.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from tests.hf_checkpoints import FAMILIES, greedy_reference, write_checkpoint

from conveyor import LLM, SamplingParams

NUM_PROMPTS = 16


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, tmp_path_factory, demo_model_dir):
    family = request.param
    path = write_checkpoint(tmp_path_factory.mktemp(family), family, demo_model_dir)
    rng = random.Random(1234)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(NUM_PROMPTS)
    ]
    max_tokens = [rng.randint(1, 24) for _ in range(NUM_PROMPTS)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = greedy_reference(hf, prompts, max_tokens)
    return family, path, prompts, max_tokens, expected


def _generate(path, prompts, max_tokens, **engine_kwargs):
    llm = LLM(str(path), **engine_kwargs)
    scheduled = []
    schedule = llm.llm_engine.scheduler.schedule

    def spy():
        out = schedule()
        # (tokens scheduled, tokens computed before, prompt length), read at schedule time
        scheduled.append(
            {
                r.request_id: (
                    out.num_scheduled_tokens[r.request_id],
                    r.num_computed_tokens,
                    r.num_prompt_tokens,
                )
                for r in out.scheduled
            }
        )
        return out

    llm.llm_engine.scheduler.schedule = spy
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs], scheduled


def test_greedy_parity_with_ample_kv(family_case):
    _, path, prompts, max_tokens, expected = family_case
    llm, got, _ = _generate(path, prompts, max_tokens, num_kv_blocks=512)
    assert got == expected
    assert llm.llm_engine.scheduler.num_preemptions == 0
    assert llm.llm_engine.scheduler.block_manager.num_free_blocks == 512


def test_greedy_parity_when_kv_cache_forces_preemption(family_case):
    _, path, prompts, max_tokens, expected = family_case
    # 8 blocks of 8 tokens hold at most two of the longer sequences at once.
    llm, got, _ = _generate(path, prompts, max_tokens, num_kv_blocks=8, block_size=8)
    assert got == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.scheduler.block_manager.num_free_blocks == 8


def test_greedy_parity_when_prompts_are_chunked(family_case):
    _, path, prompts, max_tokens, expected = family_case
    _, got, steps = _generate(path, prompts, max_tokens, max_num_batched_tokens=7)
    assert got == expected
    # A chunk is a prompt step that stops short of the prompt's end.
    chunked = [
        rid
        for step in steps
        for rid, (n, computed, num_prompt) in step.items()
        if computed < num_prompt and computed + n < num_prompt
    ]
    assert chunked, "expected at least one prompt to be split across steps"
    assert all(sum(n for n, _, _ in step.values()) <= 7 for step in steps)

"""Prompt logprobs: equal to transformers' log_softmax over the prompt, chunked or not."""

from __future__ import annotations

import pytest
import torch
import transformers

from conveyor import LLM, SamplingParams

PROMPT = list(range(40, 80))  # 40 tokens: three chunks of 16 below


@pytest.fixture(scope="module")
def reference(demo_model_dir) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(demo_model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    return logits.log_softmax(-1)


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_match_transformers(demo_model_dir, reference, chunk) -> None:
    llm = LLM(str(demo_model_dir), num_kv_blocks=32, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, n=2, temperature=1.0, seed=0)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    lps = out.prompt_logprobs
    assert len(lps) == len(PROMPT) and lps[0] is None
    for p in range(1, len(PROMPT)):
        entry, expected = lps[p], reference[p - 1]
        token = PROMPT[p]
        assert entry[token].logprob == pytest.approx(float(expected[token]), abs=1e-4)
        lp = entry[token].logprob  # rank: how many are at least as likely (float near-ties)
        assert int((expected > lp + 1e-4).sum()) < entry[token].rank
        assert entry[token].rank <= int((expected >= lp - 1e-4).sum())
        top = expected.topk(3).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= 4
    # Asked again: the prefix cache holds this prompt, but prompt logprobs still compute it.
    (again,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert [e and sorted(e) for e in again.prompt_logprobs] == [e and sorted(e) for e in lps]


def test_no_prompt_logprobs_unless_asked(demo_model_dir) -> None:
    llm = LLM(str(demo_model_dir), num_kv_blocks=16)
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt_logprobs is None

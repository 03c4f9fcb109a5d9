"""bfloat16 and float16 checkpoints load and run in the requested dtype.

Greedy tokens are compared with transformers' in the same dtype. Half precision rounds
differently in two implementations (op order, fused kernels), so the sequences must agree up
to the first step where transformers' own top-2 logits are within `NEAR_TIE[dtype]` of each
other; from there on the two continue from different tokens and are not compared.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from tests.hf_checkpoints import agree_until_a_near_tie, greedy_reference, write_checkpoint

from conveyor import LLM, SamplingParams

NEAR_TIE = {torch.bfloat16: 0.125, torch.float16: 0.02}
NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _reference(path, prompts, max_tokens, dtype):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return greedy_reference(hf, prompts, max_tokens, with_scores=True)


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("llama", torch.bfloat16), ("qwen3", torch.bfloat16), ("qwen2", torch.float16)],
)
def test_half_precision_checkpoint_runs_in_its_dtype_like_transformers(
    family, dtype, tmp_path, tiny_tokenizer_dir
):
    path = write_checkpoint(tmp_path / family, family, tiny_tokenizer_dir, dtype=dtype)
    rng = random.Random(3)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 30))] for _ in range(6)]
    max_tokens = [rng.randint(4, 16) for _ in range(6)]
    llm = LLM(str(path), dtype=NAMES[dtype], num_kv_blocks=64)
    runner = llm.llm_engine.runner
    assert runner.dtype is dtype
    assert {p.dtype for p in runner.model.parameters()} == {dtype}
    assert all(k.dtype is dtype for cache in runner.kv_caches for k in cache)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    refs = _reference(path, prompts, max_tokens, dtype)
    agreed = [
        agree_until_a_near_tie(g, tokens, scores, NEAR_TIE[dtype])
        for g, (tokens, scores) in zip(got, refs, strict=True)
    ]
    # Near-ties are rare with these weights: most tokens are compared.
    assert sum(agreed) >= 0.75 * sum(max_tokens), (agreed, max_tokens)


def test_auto_dtype_is_float32_on_cpu_for_a_bfloat16_checkpoint(tmp_path, tiny_tokenizer_dir):
    path = write_checkpoint(tmp_path / "llama", "llama", tiny_tokenizer_dir, dtype=torch.bfloat16)
    llm = LLM(str(path), num_kv_blocks=16)
    runner = llm.llm_engine.runner
    assert runner.dtype is torch.float32
    assert {p.dtype for p in runner.model.parameters()} == {torch.float32}
    # The bf16 weights upcast exactly: the fp32 run matches transformers' fp32 run exactly.
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = [5, 17, 300, 42, 7]
    ref = hf.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, 5, dtype=torch.long),
        max_new_tokens=10, do_sample=False,
    )[0, 5:].tolist()  # fmt: skip
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref

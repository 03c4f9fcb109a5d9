"""bfloat16 and float16 checkpoints load and run in the requested dtype.

Two half-precision paths on CPU. linear_backend "torch" runs the whole model in the dtype, as
transformers does; its greedy tokens must agree with transformers' in the same dtype up to the
first step where transformers' own top-2 logits are within `NEAR_TIE[dtype]` of each other
(half precision rounds differently in two implementations; from there on the two continue from
different tokens and are not compared). Our GEMM ("auto" where it is the AVX2 kernel) holds
bf16 weights under float32 activations, so it rounds differently again; it is judged by vLLM's
`check_logprobs_close` rule against transformers in bf16.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from tests.hf_checkpoints import (
    agree_until_a_near_tie,
    bf16_reference,
    greedy_reference,
    write_checkpoint,
)
from tests.logprobs_close import check_logprobs_close

from conveyor import LLM, SamplingParams
from conveyor.model.cpu import cpu_build
from conveyor.model.cpu.linear import CpuLinear

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
    llm = LLM(str(path), dtype=NAMES[dtype], num_kv_blocks=64, linear_backend="torch")
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


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_on_our_gemm_holds_bf16_weights_and_is_close_to_transformers_bf16(
    kernels, family, tmp_path, tiny_tokenizer_dir
):
    if not kernels.linear_vectorized:
        pytest.skip("dtype bfloat16 takes our GEMM by default only where it is the AVX2 one")
    path = write_checkpoint(tmp_path / family, family, tiny_tokenizer_dir, dtype=torch.bfloat16)
    rng = random.Random(5)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 30))] for _ in range(8)]
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    runner = llm.llm_engine.runner
    assert (runner.linear_backend, runner.weight_dtype) == ("cpu", torch.bfloat16)
    assert runner.dtype is torch.float32  # the activations and norms
    assert all(k.dtype is torch.bfloat16 for cache in runner.kv_caches for k in cache)
    linears = [m for m in runner.model.modules() if isinstance(m, CpuLinear)]
    assert len(linears) == 4 * 2 + 1  # qkv, o, gate_up, down per layer, and the head
    assert {m.packed_weight.dtype for m in linears} == {torch.bfloat16}
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = bf16_reference(path, prompts, [12] * len(prompts))
    diverged = check_logprobs_close(got, want)
    assert diverged <= len(prompts) // 2, diverged  # most sequences agree to the end


def test_auto_dtype_is_bfloat16_for_a_bfloat16_checkpoint_where_the_cpu_has_native_bf16(
    kernels, monkeypatch, tmp_path, tiny_tokenizer_dir
):
    if not kernels.linear_vectorized:
        pytest.skip("the bf16 path's GEMM is the AVX2 kernel")
    path = write_checkpoint(tmp_path / "llama", "llama", tiny_tokenizer_dir, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: {"avx2", "fma", "avx512_bf16"})
    runner = LLM(str(path), num_kv_blocks=16).llm_engine.runner
    assert (runner.weight_dtype, runner.kv_dtype, runner.dtype) == (
        torch.bfloat16, torch.bfloat16, torch.float32
    )  # fmt: skip


def test_auto_dtype_is_float32_on_cpu_for_a_bfloat16_checkpoint(
    monkeypatch, tmp_path, tiny_tokenizer_dir
):
    path = write_checkpoint(tmp_path / "llama", "llama", tiny_tokenizer_dir, dtype=torch.bfloat16)
    # A CPU without native bf16 dot products (on one with them, auto is bfloat16: above).
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: {"avx2", "fma"})
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

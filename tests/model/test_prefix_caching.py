"""Prefix caching end to end: the real engine on the demo checkpoint, and the KV sizing maths.

Scheduler- and block-level behaviour (hits, eviction, sharing, invariants) is tested in
test_block_manager.py and test_scheduler.py; here the model's outputs must not change when
K/V comes from the cache, and the counts users see must be right.
"""

from __future__ import annotations

import logging

import pytest

from conveyor import LLM, SamplingParams
from conveyor.core.policies import available_policies
from conveyor.model.kv_sizing import kv_bytes_from_profile

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
SYSTEM = "You are a careful assistant. Answer briefly and in plain words. " * 3


def _same_or_near_tie(got, ref) -> None:
    """Exact tokens, except where the reference's top-2 logprobs are within 1e-4 (a
    random-weight model's near-tie: cached and recomputed K/V differ by fp32 rounding)."""
    got_ids, ref_ids = got.token_ids, ref.token_ids
    k = next((i for i, (a, b) in enumerate(zip(got_ids, ref_ids, strict=True)) if a != b), None)
    if k is not None:
        top = ref.logprobs[k]
        assert got_ids[k] in top and ref_ids[k] in top, (k, top)
        assert abs(top[got_ids[k]].logprob - top[ref_ids[k]].logprob) < 1e-4, (k, top)


def _metrics(llm: LLM) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics()}


@pytest.mark.slow
def test_cached_prefixes_give_the_same_outputs_and_are_counted(demo_model_dir) -> None:
    prompts = [SYSTEM + q for q in ("What is rain?", "Name a colour.", "Count to three.")]
    cold = LLM(str(demo_model_dir), enable_prefix_caching=False)
    ref = cold.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in ref)
    assert _metrics(cold)["conveyor:prefix_cache_queries"] == 0

    llm = LLM(str(demo_model_dir))
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    block = llm.llm_engine.config.block_size
    shared = len(llm.get_tokenizer().encode(SYSTEM)) // block * block  # full blocks, at least
    for out in rest:
        assert out.num_cached_tokens >= shared > 0
        assert out.num_cached_tokens % block == 0
        assert out.num_cached_tokens < len(out.prompt_token_ids)
    for out, r in zip([first, *rest], ref, strict=True):
        _same_or_near_tie(out.outputs[0], r.outputs[0])
    m = _metrics(llm)
    assert m["conveyor:prefix_cache_hits"] == sum(o.num_cached_tokens for o in rest)
    assert m["conveyor:prefix_cache_queries"] == sum(
        len(p.prompt_token_ids) for p in [first, *rest]
    )
    assert m["conveyor:prompt_tokens"] == sum(len(p.prompt_token_ids) for p in [first, *rest])
    assert m["conveyor:generation_tokens"] == 3 * 12
    assert m["conveyor:num_requests_running"] == 0


@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_gives_the_same_greedy_outputs_with_caching_on_and_off(
    demo_model_dir, policy
) -> None:
    # Shared prefixes inside one batch, chunked prefill (budget 32) and a small cache.
    prompts = [SYSTEM + f"Question {i}: what comes next?" for i in range(6)]
    kwargs = dict(scheduler=policy, max_num_batched_tokens=32, num_kv_blocks=24)
    ref = LLM(str(demo_model_dir), enable_prefix_caching=False, **kwargs)
    ref_outs = ref.generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(demo_model_dir), **kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _metrics(llm)["conveyor:prefix_cache_hits"] > 0
    for out, r in zip(outs, ref_outs, strict=True):
        _same_or_near_tie(out.outputs[0], r.outputs[0])


@pytest.mark.slow
def test_n_samples_hold_fewer_blocks_than_n_separate_prefills(demo_model_dir) -> None:
    prompt = SYSTEM + "Tell me a story."
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=4, ignore_eos=True)
    held = {}
    for caching in (False, True):
        engine = LLM(str(demo_model_dir), enable_prefix_caching=caching).llm_engine
        engine.add_request("r", prompt, params)
        engine.step()  # the prefill of all 4 samples
        bm = engine.scheduler.block_manager
        held[caching] = bm.num_total_blocks - bm.num_free_blocks
    n_prompt = len(LLM(str(demo_model_dir)).get_tokenizer().encode(prompt))
    per_sample = -(-n_prompt // 16)
    assert held[False] == 4 * per_sample
    assert held[True] == per_sample + 3  # one copy of the full blocks + a last block each


def test_n_samples_prefill_the_prompt_once_and_seeds_still_decide(demo_model_dir) -> None:
    prompt = SYSTEM + "Tell me a story."
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=4, ignore_eos=True)
    off = LLM(str(demo_model_dir), enable_prefix_caching=False)
    ref = off.generate([prompt], params, use_tqdm=False)[0]
    llm = LLM(str(demo_model_dir))
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    # The same seeded samples as without sharing.
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    # Samples 1..3 found sample 0's full prompt blocks: only its last partial block (and at
    # least the last token) was computed again per sample.
    block = llm.llm_engine.config.block_size
    n_prompt = len(out.prompt_token_ids)
    full = (n_prompt - 1) // block * block
    m = _metrics(llm)
    assert m["conveyor:prefix_cache_hits"] == 3 * full
    assert out.num_cached_tokens == 0  # sample 0 computed the prompt: it is reported
    assert m["conveyor:prompt_tokens"] == n_prompt  # one prompt, counted once


def test_a_preempted_request_recomputes_from_its_cached_blocks(demo_model_dir) -> None:
    # 8 blocks of 16 for 8 requests that each grow to 40 tokens (3 blocks): preemptions, and
    # a victim's recompute (prompt + its outputs so far) finds some of its freed full blocks
    # before anything else took them.
    prompts = [f"Sequence {i} says something long enough to fill a block" for i in range(8)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    roomy = LLM(str(demo_model_dir), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(demo_model_dir), num_kv_blocks=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert _metrics(llm)["conveyor:prefix_cache_hits"] > 0
    for out, ref in zip(outs, roomy, strict=True):
        assert len(out.outputs[0].token_ids) == 30
        _same_or_near_tie(out.outputs[0], ref.outputs[0])
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks  # every block back


def test_the_start_up_line_gives_blocks_tokens_and_concurrency(demo_model_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="conveyor.model.kv_sizing"):
        LLM(str(demo_model_dir), num_kv_blocks=40, max_model_len=256)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache"))
    assert "40 blocks of 16 tokens (640 tokens)" in line
    assert "for 256 tokens per request: 2.50x" in line


@pytest.mark.parametrize(
    ("total", "free", "peak", "util", "expected"),
    [
        (100, 60, 10, 0.9, 90 - 40 - 10),  # weights etc. hold 40, activations peak at 10
        (100, 60, 10, 0.5, 0),  # the engine may use 50 and already needs 50
        (100, 95, 0, 1.0, 95),
    ],
)
def test_kv_bytes_from_a_profile(total, free, peak, util, expected) -> None:
    assert kv_bytes_from_profile(total, free, peak, util) == expected


def test_bad_prefix_caching_settings_are_refused() -> None:
    from conveyor.config import EngineConfig

    with pytest.raises(ValueError, match="enable_prefix_caching must be true or false"):
        EngineConfig(enable_prefix_caching="yes")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_the_cuda_profile_runs_one_forward_and_sizes_from_what_is_left(monkeypatch) -> None:
    # No GPU here: torch.cuda's memory calls are faked; the profiling forward itself runs
    # for real (on CPU) with its throwaway cache.
    import torch

    from conveyor.model import kv_sizing
    from conveyor.model.loading.demo import demo_model_path
    from conveyor.model.loading.loader import load_model

    calls = []
    fake = {
        "synchronize": lambda *a: calls.append("sync"),
        "reset_peak_memory_stats": lambda *a: calls.append("reset"),
        "max_memory_allocated": lambda *a: 700,
        "memory_allocated": lambda *a: 500,
        "empty_cache": lambda: calls.append("empty"),
        "mem_get_info": lambda *a: (400, 1000),
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    model = load_model(str(demo_model_path()), torch.float32, torch.device("cpu"))
    forwards = []
    model.register_forward_hook(lambda m, args, out: forwards.append(args[0].shape))
    got = kv_sizing.profile_cuda_kv_bytes(
        model, torch.device("cpu"), torch.float32, 48, 16, 0.9, "auto"
    )
    assert forwards == [torch.Size([48])]  # one forward of the whole token budget
    assert got == kv_sizing.kv_bytes_from_profile(1000, 400, 700 - 500, 0.9) == 100
    assert calls[:2] == ["sync", "reset"] and "empty" in calls


def test_requests_with_different_cache_salts_share_no_cached_prefix(demo_model_dir) -> None:
    llm = LLM(str(demo_model_dir))
    prompt = SYSTEM + "What is rain?"

    def cached(salt: str | None, how: str = "params") -> int:
        if how == "params":
            params = SamplingParams(max_tokens=2, temperature=0.0, cache_salt=salt)
            return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens
        given = {"prompt": prompt, "cache_salt": salt}  # vLLM's form: the salt on the prompt
        params = SamplingParams(max_tokens=2, temperature=0.0)
        return llm.generate(given, params, use_tqdm=False)[0].num_cached_tokens

    assert cached("alice") == 0
    assert cached("bob") == 0 and cached(None) == 0  # another salt, or none: a cold start
    assert cached("alice") > 0 and cached("bob") > 0 and cached(None) > 0
    assert cached("carol", "prompt") == 0 and cached("carol", "prompt") > 0
    assert cached("carol") > 0  # the prompt's salt is the params' salt
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="")

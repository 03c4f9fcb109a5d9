"""Scheduling policies and deadlines through LLM on the demo model: real model, real tokens."""

from __future__ import annotations

import random
import time

import pytest

from conveyor import LLM, SamplingParams
from conveyor.core.policies import available_policies

NUM_PROMPTS = 14


@pytest.fixture(scope="module")
def workload():
    """Mixed prompt lengths, output lengths and priorities, greedy, no early eos."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 8000) for _ in range(rng.randint(2, 40))] for _ in range(14)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(1, 24),
            ignore_eos=True,
            priority=rng.randint(0, 3),
        )
        for _ in prompts
    ]
    return prompts, params


@pytest.fixture(scope="module")
def reference(demo_model_dir, workload):
    """FIFO with a KV cache large enough that nobody is ever preempted."""
    llm = LLM(str(demo_model_dir), num_kv_blocks=256, block_size=8)
    outs = llm.generate(*workload, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("policy", available_policies())
def test_greedy_outputs_are_identical_under_every_policy_with_preemption(
    policy, demo_model_dir, workload, reference
):
    # 8 blocks of 8 tokens: the longest request needs all 8, so requests keep displacing
    # each other; preemptive-sjf may also preempt with its cooldown off.
    llm = LLM(
        str(demo_model_dir),
        scheduler=policy,
        num_kv_blocks=8,
        block_size=8,
        max_num_seqs=4,
        preemption_cooldown_s=0.0,
    )
    outs = llm.generate(*workload, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions > 0
    assert sched.block_manager.num_free_blocks == 8


def test_high_priority_arrival_preempts_a_running_request_and_finishes_first(demo_model_dir):
    llm = LLM(str(demo_model_dir), scheduler="priority", max_num_seqs=2)
    engine = llm.llm_engine
    low = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, priority=5)
    engine.add_request("low-a", [11, 12, 13], low)
    engine.add_request("low-b", [21, 22, 23, 24], low)
    finished: list[str] = []
    outputs = {}
    for _ in range(3):
        finished += [o.request_id for o in engine.step() if o.finished]
    urgent = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, priority=0)
    engine.add_request("urgent", [31, 32], urgent)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished.append(o.request_id)
                outputs[o.request_id] = o.outputs[0].token_ids
    assert finished == ["urgent", "low-a", "low-b"]
    assert engine.scheduler.num_preemptions == 1
    # low-b (admitted last among equals) was recomputed, and its tokens did not change.
    alone = llm.generate([[21, 22, 23, 24]], low, use_tqdm=False)[0].outputs[0].token_ids
    assert outputs["low-b"] == alone


def test_expired_requests_abort_with_a_reason_and_others_are_unaffected(demo_model_dir):
    llm = LLM(str(demo_model_dir), max_num_seqs=2, num_kv_blocks=64)
    sched = llm.llm_engine.scheduler
    calls = 0

    def clock() -> float:  # every schedule() is 10 "seconds" later than the real clock
        nonlocal calls
        calls += 1
        return time.monotonic() + 10.0 * calls

    sched.clock = clock
    greedy = dict(temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [
        SamplingParams(max_tokens=20, deadline=35.0, **greedy),  # cut in the 4th step
        SamplingParams(max_tokens=10, **greedy),
        SamplingParams(max_tokens=5, deadline=5.0, **greedy),  # expires while waiting
    ]
    cut, kept, never = (o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False))
    assert (cut.finish_reason, never.finish_reason, kept.finish_reason) == (
        "abort",
        "abort",
        "length",
    )
    assert len(cut.token_ids) == 3 and never.token_ids == []
    assert cut.abort_reason.startswith("deadline exceeded") and never.abort_reason
    assert kept.abort_reason is None
    assert sched.block_manager.num_free_blocks == 64
    sched.clock = time.monotonic
    alone = llm.generate([prompts[1]], params[1], use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == alone.token_ids

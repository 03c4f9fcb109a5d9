from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from conveyor.config import EngineConfig
from conveyor.core.chunking import PROMPT_LOGPROBS_CHUNK
from conveyor.core.long_prefills import LongPrefills, is_long_prefill
from conveyor.core.policies import (
    FifoPolicy,
    SchedulingPolicy,
    available_policies,
    make_policy,
    register_policy,
)
from conveyor.core.scheduler import Scheduler
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence, SequenceStatus
from conveyor.sampling_params import SamplingParams

TOKEN = 7  # what the fake model samples unless a test says otherwise


def make_scheduler(**overrides: int | str) -> Scheduler:
    # Prefix caching off unless a test turns it on: these prompts all start alike.
    kwargs: dict = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=8,
        num_kv_blocks=32,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    kwargs.update(overrides)
    return Scheduler(EngineConfig(**kwargs))


def make_request(
    request_id: str, num_prompt_tokens: int, max_tokens: int = 4, eos_token_id: int | None = None
) -> Sequence:
    prompt = [100 + i for i in range(num_prompt_tokens)]
    params = SamplingParams(max_tokens=max_tokens)
    return Sequence(request_id, prompt, params, max_tokens=max_tokens, eos_token_id=eos_token_id)


def to_sample(out: SchedulerOutput) -> list[Sequence]:
    """Requests the model samples for: those whose step reaches the end of their tokens."""
    n = out.num_scheduled_tokens
    return [r for r in out.scheduled if r.num_computed_tokens + n[r.request_id] == r.num_tokens]


def step(sched: Scheduler, token: int = TOKEN) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, {r.request_id: token for r in to_sample(out)})
    return out


def test_schedule_does_not_advance_num_computed_tokens():
    sched = make_scheduler()
    req = make_request("a", 5)
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 5}
    assert req.num_computed_tokens == 0
    assert req.status is SequenceStatus.RUNNING
    sched.update_from_output(out, {"a": TOKEN})
    assert req.num_computed_tokens == 5
    assert req.output_token_ids == [TOKEN]


def test_a_raising_stop_check_ends_that_request_alone(monkeypatch):
    sched = make_scheduler()
    good, bad = make_request("good", 5), make_request("bad", 5)
    for req in (good, bad):
        sched.add_request(req)
    real_check = Sequence.check_stop

    def check_stop(self):
        if self.request_id == "bad":
            raise RuntimeError("broken stop rule")
        return real_check(self)

    monkeypatch.setattr(Sequence, "check_stop", check_stop)
    out = sched.schedule()
    updated = sched.update_from_output(out, {"good": TOKEN, "bad": TOKEN})
    assert updated == [good, bad]
    assert bad.status is SequenceStatus.FINISHED_ABORTED and isinstance(bad.fault, RuntimeError)
    assert sched.block_manager.get_block_table("bad") == []
    assert good.status is SequenceStatus.RUNNING and good.fault is None
    assert sched.running == [good]
    step(sched)
    assert good.output_token_ids == [TOKEN, TOKEN]


def test_long_prompt_is_chunked_across_steps():
    sched = make_scheduler(max_num_batched_tokens=16)
    req = make_request("a", 40)
    sched.add_request(req)
    schedule = []
    for _ in range(4):
        out = step(sched)
        schedule.append((out.num_scheduled_tokens["a"], len(out.block_tables["a"])))
    # 16 + 16 + 8 prompt tokens, sampled after the last chunk, then one decode token.
    assert schedule == [(16, 2), (16, 4), (8, 5), (1, 6)]
    assert req.output_token_ids == [TOKEN, TOKEN]
    assert req.num_computed_tokens == 41


def test_a_prompt_with_prompt_logprobs_is_chunked_so_it_never_stalls_the_others():
    # Each prompt row of such a request is a vocabulary-wide logits row: one step of 1,900
    # of them stalled every other stream for seconds (issue 27 item 11). (The long-prefill
    # rule off: this is the prompt-logprobs chunk alone.)
    sched = make_scheduler(
        max_num_batched_tokens=2048, num_kv_blocks=512, max_model_len=4096,
        long_prefill_token_threshold=0,
    )  # fmt: skip
    decoding = make_request("d", 4, max_tokens=64)
    sched.add_request(decoding)
    step(sched)
    prompt = [100 + i % 50 for i in range(1900)]
    params = SamplingParams(max_tokens=2, prompt_logprobs=5)
    req = Sequence("p", prompt, params, max_tokens=2)
    plain = Sequence("q", prompt, SamplingParams(max_tokens=2), max_tokens=2)
    sched.add_request(req)
    sched.add_request(plain)
    counts = []
    while req.num_output_tokens == 0:
        out = step(sched)
        assert out.num_scheduled_tokens["d"] == 1  # the decoding stream gets every step
        counts.append(out.num_scheduled_tokens["p"])
    assert counts == [PROMPT_LOGPROBS_CHUNK] * 7 + [1900 - 7 * PROMPT_LOGPROBS_CHUNK]
    assert plain.is_finished  # without prompt logprobs: the rest of the budget, as usual
    assert step(sched).num_scheduled_tokens["p"] == 1  # then it decodes as usual


class CostClock:
    """A scheduler clock that each step advances by BASE_S + PER_TOKEN_S x its tokens, as a
    CPU's steps cost (their fixed part is worth 10 prompt tokens)."""

    BASE_S, PER_TOKEN_S = 0.02, 0.002

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def step(self, sched: Scheduler) -> SchedulerOutput:
        out = step(sched)
        self.now += self.BASE_S + self.PER_TOKEN_S * out.total_num_scheduled_tokens
        return out


def test_a_long_prefill_shares_each_step_with_the_decodes_and_short_prompts_pass_it():
    # Issue 49 item 4: one 8,000-token prompt took the whole budget of every step for 53 s.
    clock = CostClock()
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=2048, block_size=8, num_kv_blocks=1024,
        max_model_len=8192, enable_prefix_caching=False, long_prefill_token_threshold=256,
    )  # fmt: skip
    sched = Scheduler(config, clock=clock)
    decoding = make_request("d", 4, max_tokens=500)
    sched.add_request(decoding)
    clock.step(sched)
    clock.step(sched)  # a step of the decode alone: its time is known
    long = make_request("long", 6000, max_tokens=2)
    sched.add_request(long)
    takes, times = [], []
    for i in range(70):
        if i == 60:  # a short chat prompt arrives while the long one is in progress
            short = make_request("short", 30, max_tokens=8)
            sched.add_request(short)
        start = clock.now
        out = clock.step(sched)
        times.append(clock.now - start)
        assert out.num_scheduled_tokens["d"] == 1  # the decode gets every step
        takes.append(out.num_scheduled_tokens.get("long", 0))
        if i == 60:
            assert out.num_scheduled_tokens["short"] == 30  # admitted whole, at once
    # A decode step takes 22 ms; one long token 2 ms more: half of 22 ms is 5.5 long tokens,
    # 5 and 6 in turns once both times are measured, with a step of the decode alone (0) at
    # least every 9 to keep measuring it. Its steps take at most 1.6 times as long.
    assert takes[:3] == [1, 2, 4]  # at most doubling while the times are not known
    assert set(takes[40:60]) == {0, 5, 6} and 2 <= takes[40:60].count(0) <= 3
    assert max(times[40:60]) <= 1.6 * 0.022
    assert short.is_finished and long.num_output_tokens == 0  # passed the long one


def _dear_long_tokens() -> tuple[CostClock, Scheduler]:
    """A scheduler on a clock where one long token (10 ms) costs two decode steps (5 ms)."""
    clock = CostClock()
    clock.BASE_S, clock.PER_TOKEN_S = 0.005, 0.010
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=2048, block_size=8, num_kv_blocks=1024,
        max_model_len=8192, enable_prefix_caching=False, long_prefill_token_threshold=256,
    )  # fmt: skip
    return clock, Scheduler(config, clock=clock)


def test_a_long_token_dearer_than_a_decode_step_sits_steps_out_but_is_never_starved():
    # A prompt token deep into a long context can cost more than a whole decode step: then
    # the long prefill takes one token every few steps, keeping the decodes' steps short.
    clock, sched = _dear_long_tokens()
    sched.add_request(make_request("d", 4, max_tokens=500))
    clock.step(sched)
    clock.step(sched)
    sched.add_request(make_request("long", 3000, max_tokens=2))
    takes = [clock.step(sched).num_scheduled_tokens.get("long", 0) for _ in range(100)]
    # A decode step: 15 ms; a long token: 10 ms more; half of 15 ms is 0.75 of a token.
    assert set(takes[40:]) == {0, 1}
    assert 0.6 <= sum(takes[40:]) / 60 <= 0.9


def test_a_long_prompts_last_tokens_still_take_only_the_share_beside_decodes():
    # Below the threshold of tokens left, a long prompt's last chunk is the dearest of all
    # (deepest into its context): it stays a long prefill until its prompt is done.
    clock, sched = _dear_long_tokens()
    sched.add_request(make_request("d", 4, max_tokens=2000))
    clock.step(sched)
    long = make_request("long", 300, max_tokens=2)
    sched.add_request(long)
    takes = []
    while long.num_computed_tokens < 300:
        takes.append(clock.step(sched).num_scheduled_tokens.get("long", 0))
    assert max(takes) <= 2, takes  # never the 256-token tail at once
    assert not is_long_prefill(256, long)  # decoding now


def test_a_short_request_joining_a_long_prefill_gets_the_shared_step_not_the_alone_one():
    # Only a long prompt runs and a short request arrives: in its first step the long prompt
    # takes its share beside other work (here none yet: a token costs two decode steps),
    # not the share it takes alone (a doubling chunk).
    clock, sched = _dear_long_tokens()
    sched.add_request(make_request("long", 3000, max_tokens=1))
    for i in range(3):  # short requests one after another, so both times get measured
        short = make_request(f"s{i}", 4, max_tokens=12)
        sched.add_request(short)
        while not short.is_finished:
            clock.step(sched)
        for _ in range(2):  # alone a while: its chunk doubles
            clock.step(sched)
    sched.add_request(make_request("late", 4, max_tokens=12))
    first = clock.step(sched).num_scheduled_tokens
    assert first["late"] == 4
    assert first.get("long", 0) <= 1, first


def test_the_long_prefill_share_follows_the_measured_step_times():
    from conveyor.core.long_prefills import LongPrefills

    rule = LongPrefills(256, 4, 1)
    assert rule.share(1) == 0  # the others' time unknown: a step of theirs alone first
    rule.spend(0, 1, True)
    rule.observe(1, 0, 0.010)  # the others' step alone: 10 ms
    assert rule.share(1) == 1  # a long token's time unknown: one token a step
    rule.spend(1, 1, True)
    rule.observe(1, 4, 0.030)  # with 4 long tokens: 5 ms each
    assert rule.share(1) == 1  # half of 10 ms is one long token
    rule.spend(1, 1, True)
    gpu = LongPrefills(256, 4, 1)
    gpu.observe(1, 0, 0.010)
    gpu.observe(1, 512, 0.0101)  # a long token costs next to nothing
    takes = []
    for _ in range(10):
        takes.append(gpu.share(1))
        gpu.spend(takes[-1], 1, True)
    assert takes == [1, 2, 4, 8, 16, 32, 64, 128, 0, 256]  # doubling to T, a probe step
    assert LongPrefills(256, 4, 1).share(0) == 1  # alone: from one token, doubling too


def test_short_requests_one_after_another_get_the_others_time_measured():
    # A client's requests of fewer steps than _PROBE_EVERY, one after another, with the long
    # prompt alone in between: each got a long token in every step (the others' own step
    # time was never measured, so "one token a step" held for good), a token that costs two
    # of their steps. Now the first step beside them times them alone.
    clock, sched = _dear_long_tokens()
    sched.add_request(make_request("long", 3000, max_tokens=1))
    times = []
    for i in range(20):
        short = make_request(f"s{i}", 4, max_tokens=6)
        sched.add_request(short)
        while not short.is_finished:
            start = clock.now
            out = clock.step(sched)
            if out.num_scheduled_tokens.get(short.request_id) == 1:  # its decode steps
                times.append(clock.now - start)
        clock.step(sched)  # the long prompt alone before the next request
    # A decode step alone: 15 ms; with a long token 25 ms (1.67x). The share keeps the
    # decode steps at about 1 + TIME_SHARE times their own time on average.
    later = times[25:]
    assert sum(later) / len(later) <= 1.4 * 0.015, [round(t * 1000) for t in times]


@pytest.mark.parametrize(("comes_back_s", "holds"), [(0.002, True), (1.0, False)])
def test_the_engine_waits_for_a_returning_client_before_a_long_prefills_alone_step(
    comes_back_s, holds
):
    # A client sends one short request after another beside a long prompt. When its request
    # ends, only the long prompt is left: the next step would run it alone, and one of its
    # tokens (10 ms) costs two decode steps. Once a few gaps were seen, the engine waits for
    # a client that comes back sooner than that step would take, never for a slower one.
    clock, sched = _dear_long_tokens()
    sched.add_request(make_request("long", 3000, max_tokens=1))
    holds_s = []
    back_at = 0.0
    for i in range(10):
        short = make_request(f"s{i}", 4, max_tokens=12)
        short.arrival_time = back_at
        sched.add_request(short)
        assert sched.hold_s() == 0.0  # a short request is waiting: no wait
        while not short.is_finished:
            clock.step(sched)
            assert short.is_finished or sched.hold_s() == 0.0  # it is still running
        holds_s.append(sched.hold_s())
        back_at = clock.now + comes_back_s
        if holds_s[-1] >= comes_back_s:  # the engine waits, and the client is back
            clock.now = back_at
        while clock.now < back_at:  # else it runs the long prompt alone meanwhile
            clock.step(sched)
    assert holds_s[:4] == [0.0] * 4  # too few gaps seen yet
    hold_s = pytest.approx(comes_back_s + LongPrefills.HOLD_MARGIN_S)
    assert holds_s[4:] == ([hold_s] * 6 if holds else [0.0] * 6)


def test_a_long_prefill_alone_doubles_its_chunk_up_to_the_threshold():
    sched = make_scheduler(
        max_num_batched_tokens=2048, num_kv_blocks=512, max_model_len=4096,
        long_prefill_token_threshold=64,
    )  # fmt: skip
    sched.add_request(make_request("long", 400, max_tokens=1))
    takes = [step(sched).num_scheduled_tokens["long"] for _ in range(12)]
    # 1, 2, 4, ... up to 64; the last 64 or fewer tokens are no longer a long prefill.
    assert takes == [1, 2, 4, 8, 16, 32, 64, 64, 64, 64, 64, 17]


def test_long_prefills_run_one_at_a_time_and_shorter_requests_behind_them_are_admitted():
    # An embeddings batch of many long inputs, then a short request: FIFO order, but the
    # short one does not wait for the inputs before it.
    sched = make_scheduler(
        max_num_seqs=32, max_num_batched_tokens=2048, num_kv_blocks=2048, max_model_len=4096,
        long_prefill_token_threshold=256, max_long_partial_prefills=1,
    )  # fmt: skip
    inputs = [make_request(f"in{i}", 2000, max_tokens=1) for i in range(24)]
    for req in inputs:
        sched.add_request(req)
    step(sched)
    short = make_request("short", 12, max_tokens=4)
    sched.add_request(short)
    out = step(sched)
    assert out.num_scheduled_tokens["short"] == 12
    assert [r.request_id for r in sched.running] == ["in0", "short"]
    assert [r.request_id for r in sched.waiting] == [f"in{i}" for i in range(1, 24)]
    for _ in range(3):
        step(sched)
    assert short.is_finished and not inputs[0].is_finished


def test_the_long_prefill_rule_off_lets_a_prompt_take_the_whole_budget():
    sched = make_scheduler(
        max_num_batched_tokens=2048, num_kv_blocks=512, max_model_len=4096,
        long_prefill_token_threshold=0,
    )  # fmt: skip
    sched.add_request(make_request("d", 4, max_tokens=50))
    step(sched)
    sched.add_request(make_request("long", 3000, max_tokens=1))
    assert step(sched).num_scheduled_tokens == {"d": 1, "long": 2047}


def test_prompts_left_unfinished_by_a_step_are_capped_by_max_num_partial_prefills():
    sched = make_scheduler(
        max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=64, max_model_len=256,
        max_num_partial_prefills=1, max_long_partial_prefills=1, long_prefill_token_threshold=0,
    )  # fmt: skip
    for i in range(3):
        sched.add_request(make_request(f"p{i}", 40, max_tokens=1))
    out = step(sched)
    assert out.num_scheduled_tokens == {"p0": 16}  # p1 would be a second unfinished prompt
    assert step(sched).num_scheduled_tokens == {"p0": 16}
    assert step(sched).num_scheduled_tokens == {"p0": 8, "p1": 8}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("long_prefill_token_threshold", -1, "long_prefill_token_threshold"),
        ("max_num_partial_prefills", 0, "max_num_partial_prefills"),
        ("max_long_partial_prefills", 5, "at most max_num_partial_prefills"),
    ],
)
def test_prefill_settings_are_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_running_decodes_go_first_and_new_prompt_takes_the_rest_of_the_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    a, b = make_request("a", 10, max_tokens=8), make_request("b", 30, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    outs = [step(sched) for _ in range(4)]
    assert [o.num_scheduled_tokens for o in outs] == [
        {"a": 10, "b": 6},
        {"a": 1, "b": 15},
        {"a": 1, "b": 9},  # b's prompt completes: sampled
        {"a": 1, "b": 1},
    ]
    assert [[r.request_id for r in o.scheduled] for o in outs] == [["a", "b"]] * 4
    assert [o.total_num_scheduled_tokens for o in outs] == [16, 16, 10, 2]
    assert (a.num_output_tokens, b.num_output_tokens) == (4, 2)


def test_token_budget_caps_the_step_and_chunks_the_last_prompt():
    sched = make_scheduler(max_num_batched_tokens=10)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 4))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r0": 4, "r1": 4, "r2": 2}
    assert out.total_num_scheduled_tokens == 10
    assert [r.request_id for r in sched.waiting] == ["r3"]


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("r0", 4, max_tokens=1))
    for i in range(1, 5):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=3))
    out = step(sched)
    assert out.num_scheduled_tokens == {"r0": 4, "r1": 4}
    assert sched.num_waiting == 3
    assert sched.requests.get("r0") is None  # finished after one token
    out = step(sched)
    assert out.num_scheduled_tokens == {"r1": 1, "r2": 4}
    assert out.finished_request_ids == ["r0"]
    assert sched.num_running == 2


def test_preempts_most_recently_admitted_when_blocks_run_out():
    # 4 blocks of 8 slots: two 16-token prompts fill the cache.
    sched = make_scheduler(num_kv_blocks=4)
    a, b = make_request("a", 16, max_tokens=3), make_request("b", 16, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    out1 = step(sched)
    assert out1.num_scheduled_tokens == {"a": 16, "b": 16}
    assert sched.block_manager.num_free_blocks == 0
    c = make_request("c", 8, max_tokens=1)
    sched.add_request(c)

    # a's 17th token needs a third block: b (admitted last) is preempted, nothing admitted.
    out2 = step(sched)
    assert out2.num_scheduled_tokens == {"a": 1}
    assert out2.preempted_request_ids == ["b"]
    assert b.status is SequenceStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.block_manager.get_block_table("b") == []
    assert list(sched.waiting) == [b, c]  # re-queued at the front
    assert sched.block_manager.num_free_blocks == 1

    # b needs 3 blocks for its 17 tokens, only 1 is free: FIFO admits nobody behind it.
    out3 = step(sched)
    assert out3.num_scheduled_tokens == {"a": 1}
    assert a.status is SequenceStatus.FINISHED_LENGTH
    assert sched.block_manager.num_free_blocks == 4  # freed at once

    # b recomputes prompt + its first output token, then c gets the last block.
    out4 = step(sched)
    assert out4.finished_request_ids == ["a"]
    assert out4.num_scheduled_tokens == {"b": 17, "c": 8}
    assert out4.preempted_request_ids == []
    assert b.output_token_ids == [TOKEN, TOKEN]
    assert b.num_computed_tokens == 17
    assert c.status is SequenceStatus.FINISHED_LENGTH


def test_request_that_must_preempt_itself_only_shrinks_the_step():
    sched = make_scheduler(num_kv_blocks=4)
    a, b = make_request("a", 12, max_tokens=5), make_request("b", 16, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 2 blocks (13 tokens still fit), b: 2 blocks (17 do not)
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_request_ids == ["b"]
    assert list(sched.waiting) == [b]
    out = step(sched)  # b needs 3 blocks, 2 are free
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_request_ids == []


class OldestVictimPolicy(FifoPolicy):
    """Preempts the earliest admitted request, which may already be scheduled this step."""

    def select_victim(self, running: list[Sequence]) -> Sequence:
        return running[0]


def test_preempting_an_already_scheduled_request_returns_its_tokens():
    sched = make_scheduler(num_kv_blocks=4)
    sched.policy = OldestVictimPolicy(EngineConfig())
    a, b = make_request("a", 12, max_tokens=5), make_request("b", 16, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out = sched.schedule()  # a is scheduled first, then gives way to b's new block
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.scheduled == [b]
    assert out.total_num_scheduled_tokens == 1
    assert out.preempted_request_ids == ["a"]
    assert sched.running == [b]
    assert list(sched.waiting) == [a]


def test_finished_request_frees_its_blocks():
    sched = make_scheduler()
    req = make_request("a", 20, max_tokens=10, eos_token_id=2)
    sched.add_request(req)
    step(sched)
    assert sched.block_manager.num_free_blocks == 32 - 3
    step(sched, token=2)  # eos
    assert req.status is SequenceStatus.FINISHED_STOPPED
    assert req.output_token_ids == [TOKEN, 2]
    assert sched.block_manager.get_block_table("a") == []
    assert sched.block_manager.num_free_blocks == 32
    assert sched.running == [] and not sched.has_unfinished_requests()
    assert sched.schedule().finished_request_ids == ["a"]
    assert sched.schedule().finished_request_ids == []


def test_update_returns_requests_with_a_new_token():
    sched = make_scheduler(max_num_batched_tokens=6)
    sched.add_request(make_request("a", 4, max_tokens=1))
    sched.add_request(make_request("b", 4))
    out = sched.schedule()  # a: 4 tokens (sampled), b: 2 of 4 (not sampled)
    got = sched.update_from_output(out, {"a": TOKEN})
    assert [r.request_id for r in got] == ["a"]
    assert got[0].status is SequenceStatus.FINISHED_LENGTH
    assert [r.request_id for r in sched.running] == ["b"]


def test_finish_requests_aborts_waiting_and_running_requests():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 10), make_request("b", 10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.running == [a] and list(sched.waiting) == [b]

    assert sched.finish_requests(["b", "unknown"], SequenceStatus.FINISHED_ABORTED) == [b]
    assert b.status is SequenceStatus.FINISHED_ABORTED
    assert sched.num_waiting == 0

    assert sched.finish_requests(["a"], SequenceStatus.FINISHED_ABORTED) == [a]
    assert a.status.finish_reason == "abort"
    assert sched.block_manager.get_block_table("a") == []
    assert sched.block_manager.num_free_blocks == 32
    assert sched.finish_requests(["a", "b"], SequenceStatus.FINISHED_ABORTED) == []
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_request_ids == ["b", "a"]
    assert out.scheduled == []


def test_finish_requests_with_stop_status_keeps_it():
    sched = make_scheduler()
    req = make_request("a", 4)
    sched.add_request(req)
    step(sched)
    sched.finish_requests(["a"], SequenceStatus.FINISHED_STOPPED)
    assert req.status.finish_reason == "stop"


def test_finish_requests_rejects_an_unfinished_status():
    with pytest.raises(ValueError, match="finished status"):
        make_scheduler().finish_requests(["a"], SequenceStatus.RUNNING)


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    req = make_request("a", 4)
    sched.add_request(req)
    out = sched.schedule()
    sched.finish_requests(["a"], SequenceStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, {"a": TOKEN}) == []
    assert req.output_token_ids == [] and req.num_computed_tokens == 0
    assert sched.block_manager.num_free_blocks == 32


def test_add_request_rejects_what_could_never_run():
    sched = make_scheduler(num_kv_blocks=2)  # 16 slots
    sched.add_request(make_request("fits", 10, max_tokens=7))  # 16 cached tokens at most
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("too-big", 10, max_tokens=8))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("fits", 1))
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(make_request("empty", 0))


def test_unresolved_config_is_rejected():
    with pytest.raises(ValueError, match="resolved"):
        Scheduler(EngineConfig(num_kv_blocks=None, max_model_len=128))


def test_unknown_policy_name_lists_the_choices():
    with pytest.raises(ValueError, match="choose one of: fifo"):
        make_policy("nope", EngineConfig())
    with pytest.raises(ValueError, match="scheduler must be one of fifo"):
        make_scheduler(scheduler="nope")
    assert "fifo" in available_policies()
    assert isinstance(make_policy("fifo", EngineConfig()), FifoPolicy)


def test_registering_a_second_policy_under_a_taken_name_fails():
    class Impostor(FifoPolicy):
        name = "fifo"

    with pytest.raises(ValueError, match="already registered"):
        register_policy(Impostor)


def test_tight_cache_workload_runs_to_completion_with_preemptions():
    sched = make_scheduler(num_kv_blocks=6, max_num_batched_tokens=20, max_num_seqs=4)
    reqs = [make_request(f"r{i}", 5 + 3 * i, max_tokens=12) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert all(r.status is SequenceStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.output_token_ids == [TOKEN] * 12 for r in reqs)
    assert sched.num_preemptions > 0
    assert sched.block_manager.num_free_blocks == 6


# --- property tests -----------------------------------------------------------------------


class RandomPolicy(FifoPolicy):
    """Adversarial policy: random victims and random voluntary preemptions."""

    def __init__(self, config: EngineConfig, rng: random.Random) -> None:
        super().__init__(config)
        self.rng = rng

    def select_victim(self, running: list[Sequence]) -> Sequence:
        return self.rng.choice(running)

    def select_preemptions(self, running, waiting, now) -> list[Sequence]:
        return [self.rng.choice(running)] if self.rng.random() < 0.2 else []


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / schedule / update / abort / clock ticks against a small cache, under every
    registered policy (and an adversarial one), with priorities, deadlines, length hints and
    three tenants."""

    @initialize(
        block_size=st.sampled_from([8, 16]),
        num_kv_blocks=st.integers(2, 10),
        budget=st.integers(1, 48),
        max_num_seqs=st.integers(1, 6),
        seed=st.integers(0, 2**16),
        random_policy=st.booleans(),
        policy=st.sampled_from(available_policies()),
        aging_bound_s=st.sampled_from([0.5, 5.0, math.inf]),
        preemption_threshold=st.sampled_from([0.5, 1.0]),
        preemption_cooldown_s=st.sampled_from([0.0, 1.0]),
        prefix_caching=st.booleans(),
        long_threshold=st.sampled_from([0, 1, 3, 8, 24, 256]),
        max_partial=st.integers(1, 3),
        max_long=st.integers(1, 3),
    )
    def setup(
        self,
        block_size,
        num_kv_blocks,
        budget,
        max_num_seqs,
        seed,
        random_policy,
        policy,
        aging_bound_s,
        preemption_threshold,
        preemption_cooldown_s,
        prefix_caching,
        long_threshold,
        max_partial,
        max_long,
    ):
        self.config = EngineConfig(
            long_prefill_token_threshold=long_threshold,
            max_num_partial_prefills=max_partial,
            max_long_partial_prefills=min(max_long, max_partial),
            enable_prefix_caching=prefix_caching,
            scheduler=policy,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=num_kv_blocks * block_size,
            aging_bound_s=aging_bound_s,
            preemption_threshold=preemption_threshold,
            preemption_cooldown_s=preemption_cooldown_s,
        )
        self.now = 0.0
        self.sched = Scheduler(self.config, clock=lambda: self.now)
        self.rng = random.Random(seed)
        self.policy: SchedulingPolicy = self.sched.policy
        if random_policy:
            self.policy = self.sched.policy = RandomPolicy(self.config, self.rng)
        self.capacity = num_kv_blocks * block_size
        self.pending: SchedulerOutput | None = None
        self.added: dict[str, Sequence] = {}
        self.finish_events: Counter[str] = Counter()
        self.reported_finished: Counter[str] = Counter()
        # What the fake model has written into each KV slot: (block, offset) -> token id.
        self.kv: dict[tuple[int, int], int] = {}
        self.last_long_tokens = 0  # what long prefills took in the previous step

    @rule(
        prompt_len=st.integers(1, 64),
        max_tokens=st.integers(1, 12),
        eos=st.booleans(),
        priority=st.integers(0, 3),
        deadline=st.none() | st.floats(0.5, 8.0),
        length_hint=st.none() | st.integers(1, 12),
        fork=st.integers(0, 64),
        tenant=st.sampled_from(["", "a", "b"]),
    )
    def add_request(
        self, prompt_len, max_tokens, eos, priority, deadline, length_hint, fork, tenant
    ):
        prompt_len = min(prompt_len, self.capacity)
        max_tokens = min(max_tokens, self.capacity - prompt_len + 1)  # the cache can hold it
        params = SamplingParams(
            max_tokens=max_tokens,
            priority=priority,
            deadline=deadline,
            length_hint=length_hint,
            tenant=tenant,
        )
        # Prompts share prefixes (so the prefix cache hits) and differ after `fork` tokens.
        req = Sequence(
            f"r{len(self.added)}",
            [100 + i if i < fork else 50 + len(self.added) for i in range(prompt_len)],
            params,
            max_tokens=max_tokens,
            eos_token_id=0 if eos else None,
            arrival_time=self.now,
        )
        self.sched.add_request(req)
        self.added[req.request_id] = req

    @rule(dt=st.floats(0.0, 2.0))
    def advance_clock(self, dt):
        self.now += dt

    @precondition(lambda self: self.pending is None)
    @rule()
    def schedule(self):
        # With no free block at the step's start the long-prefill share is off (scheduler.py)
        self.was_pressed = getattr(self, "pressed", False)
        self.pressed = self.sched.block_manager.num_free_blocks == 0
        out = self.sched.schedule()
        cfg, bm = self.config, self.sched.block_manager
        ids = [r.request_id for r in out.scheduled]
        assert len(ids) == len(set(ids)) <= cfg.max_num_seqs
        assert set(out.num_scheduled_tokens) == set(out.block_tables) == set(ids)
        total = sum(out.num_scheduled_tokens.values())
        assert total == out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        positions = [self.sched.running.index(r) for r in out.scheduled]
        assert positions == sorted(positions)  # running first, then the newly admitted
        for r in out.scheduled:
            n = out.num_scheduled_tokens[r.request_id]
            assert r.status is SequenceStatus.RUNNING
            end = r.num_computed_tokens + n
            assert n >= 1 and end <= r.num_tokens
            assert len(bm.get_block_table(r.request_id)) * bm.block_size >= end
        for rid in out.preempted_request_ids:
            assert self.added[rid].status is SequenceStatus.PREEMPTED
            assert rid not in out.num_scheduled_tokens
        for rid in out.finished_request_ids:
            req = self.added[rid]
            assert req.is_finished
            self.reported_finished[rid] += 1
            if req.abort_reason is not None:  # its deadline passed inside this schedule()
                assert req.status is SequenceStatus.FINISHED_ABORTED
                assert req.deadline_at <= self.now
                self.finish_events[rid] += 1
        # Nobody still queued is past its deadline.
        assert all(r.deadline_at > self.now for r in [*self.sched.running, *self.sched.waiting])
        self.check_long_prefills(out)
        self.pending = out

    def check_long_prefills(self, out: SchedulerOutput) -> None:
        """The prefill rules (core/chunking.py): limits on prefills in progress, the long
        ones' share of the step, and no running request left out of a step with budget."""
        cfg, n = self.config, out.num_scheduled_tokens
        threshold = cfg.long_prefill_token_threshold
        running = self.sched.running
        # (schedule() advances nothing: a request's tokens left are those at the step's start.)
        left = {r.request_id: r.num_tokens - r.num_computed_tokens for r in running}
        after = [left[r.request_id] - n.get(r.request_id, 0) for r in running]
        assert sum(a > 1 for a in after) <= cfg.max_num_partial_prefills
        if threshold:
            longs = [r for r in running if is_long_prefill(threshold, r)]
            assert len(longs) <= cfg.max_long_partial_prefills
            long_total = sum(n.get(r.request_id, 0) for r in longs)
            assert all(n.get(r.request_id, 0) <= threshold for r in longs)
            if not self.pressed:  # (else in running order, as any request: no share)
                # The share comes from what the running others took before any admission.
                new = {r.request_id for r in out.admitted} | {r.request_id for r in longs}
                others = sum(k for rid, k in n.items() if rid not in new)
                # Alone: the doubling (unless the step before had no free block: its long
                # prompts then ran in place, as any request, and the rule counts them its way).
                if not out.preempted_request_ids and not others and not self.was_pressed:
                    ramp = min(threshold, max(1, 2 * self.last_long_tokens))
                    assert long_total <= max(len(longs), ramp)
            else:  # the rule counts only the long prompts admitted (the running ones ran in
                # place, as any request)
                admitted = {r.request_id for r in out.admitted}
                long_total = sum(n.get(r.request_id, 0) for r in longs if r.request_id in admitted)
            if long_total or out.total_num_scheduled_tokens == long_total:
                self.last_long_tokens = long_total  # (a step sat out keeps the last)
        if out.total_num_scheduled_tokens < cfg.max_num_batched_tokens:
            # Budget to spare: every running request but a long prefill (which may sit a step
            # out beside others) got some, unless a preemption cut the step short.
            # A tenant's request may sit a step out beside other tenants' work
            # (core/tenant_shares.py), never all of that tenant's requests.
            served = {r.tenant for r in running if r.request_id in n}
            starved = [
                r.request_id
                for r in running
                if left[r.request_id] > 0
                and r.request_id not in n
                and not is_long_prefill(threshold, r)
                and r.tenant not in served
            ]
            assert out.preempted_request_ids or not starved, (left, n)

    @precondition(lambda self: self.pending is not None)
    @rule()
    def update(self):
        out, self.pending = self.pending, None
        # The fake model runs the whole scheduled batch (aborted-meanwhile rows too, as the
        # runner does): every new token's K/V goes to its slot, all of them before anything
        # attends. Then each request still running must find its whole context in its table:
        # shared blocks and prefix-cache hits hold exactly its tokens.
        bs = self.sched.block_manager.block_size
        for r in out.scheduled:
            table, tokens = out.block_tables[r.request_id], r.all_token_ids
            for pos in range(
                r.num_computed_tokens,
                r.num_computed_tokens + out.num_scheduled_tokens[r.request_id],
            ):
                self.kv[table[pos // bs], pos % bs] = tokens[pos]
        for r in out.scheduled:
            if r.status is SequenceStatus.RUNNING:
                table, tokens = out.block_tables[r.request_id], r.all_token_ids
                end = r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
                seen = [self.kv.get((table[p // bs], p % bs)) for p in range(end)]
                assert seen == tokens[:end], f"{r.request_id} would attend to wrong K/V"
        # The fake model samples for every request reaching the end of its tokens; 0 is eos.
        sampled = {r.request_id: self.rng.randrange(8) for r in to_sample(out)}
        for req in self.sched.update_from_output(out, sampled):
            assert req.request_id in sampled
            if req.is_finished:
                self.finish_events[req.request_id] += 1

    @rule(data=st.data(), stop=st.booleans())
    def finish_from_outside(self, data, stop):
        rid = data.draw(st.sampled_from([*self.added, "unknown"]), label="request_id")
        was_open = rid in self.added and not self.added[rid].is_finished
        status = SequenceStatus.FINISHED_STOPPED if stop else SequenceStatus.FINISHED_ABORTED
        done = self.sched.finish_requests([rid], status)
        assert [r.request_id for r in done] == ([rid] if was_open else [])
        for req in done:
            assert req.status is status
            self.finish_events[rid] += 1

    @invariant()
    def state_is_consistent(self):
        sched, bm = self.sched, self.sched.block_manager
        free = list(bm.free_block_queue)
        assert len(free) == len(set(free))  # no block freed twice
        assert min(bm.ref_counts) >= 0
        assert sum(1 for c in bm.ref_counts if c > 0) + bm.num_free_blocks == bm.num_total_blocks
        assert all(bm.ref_counts[b] == 0 for b in free)
        assert len(sched.running) == len(set(map(id, sched.running))) <= self.config.max_num_seqs
        assert all(r.status is SequenceStatus.RUNNING for r in sched.running)
        waiting_states = (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
        assert all(r.status in waiting_states for r in sched.waiting)
        open_reqs = {rid for rid, r in self.added.items() if not r.is_finished}
        queued = [r.request_id for r in sched.running] + [r.request_id for r in sched.waiting]
        assert sorted(queued) == sorted(open_reqs)
        pending = self.pending.num_scheduled_tokens if self.pending else {}
        holders: Counter[int] = Counter()
        for rid, req in self.added.items():
            table = bm.get_block_table(rid)
            if req.status is SequenceStatus.RUNNING:
                need = req.num_computed_tokens + pending.get(rid, 0)
                assert len(table) == cdiv(need, bm.block_size)
            else:  # waiting, preempted or finished: holds nothing
                assert table == []
                assert req.is_finished or req.num_computed_tokens == 0
            assert len(set(table)) == len(table)
            holders.update(table)
            assert self.finish_events[rid] == (1 if req.is_finished else 0)
        # A block's ref count is the number of tables holding it; shared only when caching.
        assert all(bm.ref_counts[b] == holders[b] for b in range(bm.num_total_blocks))
        assert self.config.enable_prefix_caching or max(holders.values(), default=1) == 1
        # The cache index and the blocks' hashes agree.
        assert all(bm.block_hash[b] == h for h, b in bm.cached_blocks.items())
        assert sum(h is not None for h in bm.block_hash) == len(bm.cached_blocks)
        assert sched.num_preemptions == sum(r.num_preemptions for r in self.added.values())
        assert all(c == 1 for c in self.reported_finished.values())

    def teardown(self):
        if not hasattr(self, "sched") or isinstance(self.policy, RandomPolicy):
            return
        # Progress: under FIFO the oldest running request is never the victim (unless alone,
        # and then it fits), so each step brings it one token closer to its end. The other
        # policies may preempt for waiting requests, but only for strictly better ones
        # (priority; preemptive-sjf: shorter than every running one), so they do not cycle;
        # each preemption costs at most a recompute of the victim.
        if self.pending is not None:
            self.update()
        open_reqs = [r for r in self.added.values() if not r.is_finished]
        limit = sum(r.num_prompt_tokens + r.max_tokens for r in open_reqs) + len(open_reqs) + 1
        limit *= 1 if self.config.scheduler == "fifo" else 1 + len(open_reqs)
        for _ in range(limit):
            if not self.sched.has_unfinished_requests():
                break
            self.schedule()
            self.update()
            self.state_is_consistent()
        assert not self.sched.has_unfinished_requests()
        self.schedule()  # hands over the last finished ids
        assert self.pending is not None and self.pending.scheduled == []
        assert all(self.finish_events[rid] == 1 for rid in self.added)
        assert all(self.reported_finished[rid] == 1 for rid in self.added)
        assert self.sched.block_manager.num_free_blocks == self.config.num_kv_blocks


def test_random_workloads_keep_scheduler_invariants_and_finish_every_request():
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(max_examples=200, stateful_step_count=50, deadline=None),
    )


def test_a_cached_prefix_is_skipped_and_charges_the_budget_only_for_the_rest():
    sched = make_scheduler(enable_prefix_caching=True)
    a = make_request("a", 20, max_tokens=1)
    sched.add_request(a)
    while sched.has_unfinished_requests():
        step(sched)
    assert a.num_cached_tokens == 0
    b = make_request("b", 24, max_tokens=1)  # a's 20 prompt tokens, then 4 more
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 8}  # blocks 0 and 1 (16 tokens) were cached
    assert out.total_num_scheduled_tokens == 8
    assert b.num_computed_tokens == 16 and b.num_cached_tokens == 16
    assert out.admitted == [b]
    bm = sched.block_manager
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20 + 24, 16)


def test_samples_of_one_prompt_admitted_together_compute_it_once():
    sched = make_scheduler(enable_prefix_caching=True)
    seqs = [make_request(f"p#{i}", 20) for i in range(3)]
    for s in seqs:
        sched.add_request(s)
    out = sched.schedule()
    # The first computes all 20; the others find its two full blocks registered for this
    # very step and compute only the partial last block.
    assert out.num_scheduled_tokens == {"p#0": 20, "p#1": 4, "p#2": 4}
    bm = sched.block_manager
    tables = [bm.get_block_table(s.request_id) for s in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3  # each sample writes its own last block
    assert [bm.ref_counts[b] for b in tables[0][:2]] == [3, 3]


def test_prefix_caching_off_computes_every_prompt_in_full():
    sched = make_scheduler()
    for i in range(3):
        sched.add_request(make_request(f"p#{i}", 20))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"p#0": 20, "p#1": 20, "p#2": 20}


@pytest.mark.parametrize("long_threshold", [0, 8])
def test_preemption_frees_no_seat_for_a_long_prompt_admission_would_pass_over(long_threshold):
    # X, a long prompt in progress, holds blocks that Z (shorter output, long prompt) needs.
    # With the long-prefill rule (one long prefill at a time) admission passes Z over while
    # X runs, so preempting X for Z would hand X's seat to someone else, and the state
    # machine found two requests preempting each other that way forever.
    now = [0.0]
    sched = Scheduler(
        EngineConfig(
            scheduler="preemptive-sjf", preemption_cooldown_s=0.0, aging_bound_s=math.inf,
            max_num_seqs=6, max_num_batched_tokens=42, block_size=16, num_kv_blocks=9,
            max_model_len=256, enable_prefix_caching=False,
            long_prefill_token_threshold=long_threshold, max_num_partial_prefills=1,
            max_long_partial_prefills=1,
        ),
        clock=lambda: now[0],
    )  # fmt: skip
    x = make_request("x", 100, max_tokens=7)
    sched.add_request(x)
    while x.num_computed_tokens < 16:
        step(sched)
        now[0] += 0.01
    z = make_request("z", 61, max_tokens=1)
    sched.add_request(z)
    victims = sched.policy.select_preemptions(sched.running, sched.waiting, now[0])
    assert victims == ([] if long_threshold else [x])


@pytest.mark.parametrize("max_partial", [1, 2])
def test_preemption_frees_no_seat_for_a_prompt_admission_would_leave_waiting(max_partial):
    # X, a prompt in progress, is the one partial prefill allowed; Z (waiting, higher
    # priority than Y) is longer than a step's budget, so admission passes it over while X
    # is in progress. Preempting Y for Z would hand Y's seat to the next waiting request,
    # and the state machine found Y and that request preempting each other forever.
    sched = make_scheduler(
        scheduler="priority", max_num_seqs=2, max_num_batched_tokens=20,
        max_num_partial_prefills=max_partial, long_prefill_token_threshold=0,
    )  # fmt: skip
    x, y = make_request("x", 60, max_tokens=1), make_request("y", 3, max_tokens=50)
    z = make_request("z", 30)
    for req, priority in ((x, 0), (y, 2), (z, 1)):
        req.sampling_params.priority = priority
    sched.add_request(y)
    step(sched)
    sched.add_request(x)
    step(sched)
    assert [r.request_id for r in sched.running] == ["y", "x"] and x.num_computed_tokens < 60
    sched.add_request(z)
    victims = sched.policy.select_preemptions(sched.running, sched.waiting, 0.0)
    assert victims == ([] if max_partial == 1 else [y])

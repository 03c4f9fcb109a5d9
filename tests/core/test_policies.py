"""Each scheduling policy's ordering and preemption decisions on small hand-made scenarios.

The scheduler runs for real with a fake model (it samples token 7, or eos 0 where a test
says so) and a fake clock, so every expected order is exact.
"""

from __future__ import annotations

import math

import pytest

from conveyor.config import EngineConfig
from conveyor.core.policies import available_policies, make_policy
from conveyor.core.scheduler import Scheduler
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence, SequenceStatus
from conveyor.sampling_params import SamplingParams

TOKEN = 7


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(clock: Clock | None = None, **overrides) -> Scheduler:
    # Prefix caching off: these prompts repeat one token, so every one would hit.
    kwargs: dict = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=8,
        num_kv_blocks=64,
        max_model_len=512,
        enable_prefix_caching=False,
    )
    kwargs.update(overrides)
    return Scheduler(EngineConfig(**kwargs), clock=clock or Clock())


def req(
    rid: str,
    max_tokens: int = 4,
    prompt: int = 4,
    arrival: float = 0.0,
    priority: int = 0,
    deadline: float | None = None,
    length_hint: int | None = None,
) -> Sequence:
    params = SamplingParams(
        max_tokens=max_tokens, priority=priority, deadline=deadline, length_hint=length_hint
    )
    return Sequence(
        rid, [100 + i for i in range(prompt)], params, max_tokens=max_tokens, arrival_time=arrival
    )


def step(sched: Scheduler, finished: list[str] | None = None) -> SchedulerOutput:
    """One schedule + fake-model update; appends the ids that finished to `finished`."""
    out = sched.schedule()
    n = out.num_scheduled_tokens
    sampled = {
        r.request_id: TOKEN
        for r in out.scheduled
        if r.num_computed_tokens + n[r.request_id] == r.num_tokens
    }
    for r in sched.update_from_output(out, sampled):
        if r.is_finished and finished is not None:
            finished.append(r.request_id)
    return out


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def run_to_end(sched: Scheduler, clock: Clock | None = None, dt: float = 0.0) -> list[str]:
    """Step until idle; returns request ids in the order they finished."""
    order: list[str] = []
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            return order
        step(sched, order)
        if clock is not None:
            clock.now += dt
    raise AssertionError("the scheduler did not finish")


def test_all_six_policies_are_registered():
    assert available_policies() == [
        "fifo",
        "length-aware",
        "preemptive-sjf",
        "priority",
        "sjf",
        "static",
    ]


def test_fifo_keeps_queue_order():
    waiting = [req("a", 50), req("b", 1), req("c", 9)]
    assert ids(make_policy("fifo", EngineConfig()).order_waiting(waiting, 0.0)) == ["a", "b", "c"]


def test_sjf_orders_by_expected_output_then_deadline_then_arrival():
    policy = make_policy("sjf", EngineConfig(aging_bound_s=math.inf))
    waiting = [
        req("a", 30),
        req("b", 10, arrival=0.5),
        req("c", 10, arrival=0.9, deadline=5.0),  # same length as b, earlier deadline
        req("d", 50, length_hint=5),  # the hint, not max_tokens, is its expected length
        req("e", 10, arrival=0.2),
    ]
    assert ids(policy.order_waiting(waiting, now=1.0)) == ["d", "c", "e", "b", "a"]


def test_sjf_aging_lets_an_old_long_request_pass_newer_short_ones():
    policy = make_policy("sjf", EngineConfig(aging_bound_s=10.0))
    long = req("long", 100, arrival=0.0)
    # At t = 5 the long request ranks as 100 * (1 - 5/10) = 50: a fresh 10-token one is first.
    assert ids(policy.order_waiting([long, req("s1", 10, arrival=5.0)], 5.0)) == ["s1", "long"]
    # At t = 9.5 it ranks as 5 < 10.
    assert ids(policy.order_waiting([long, req("s2", 10, arrival=9.5)], 9.5)) == ["long", "s2"]
    # Past the bound nobody newer passes it, not even a 1-token request.
    assert ids(policy.order_waiting([req("s3", 1, arrival=12.0), long], 12.0)) == ["long", "s3"]


def test_length_aware_alternates_short_and_long_around_the_mean():
    policy = make_policy("length-aware", EngineConfig(aging_bound_s=math.inf))
    waiting = [req("50", 50), req("1", 1), req("100", 100), req("2", 2), req("10", 10)]
    # Target = mean 32.6. Empty batch: shortest (1); batch mean 1 < target: longest (100);
    # mean 50.5 > target: shortest left (2); mean 34.3 > target: 10; mean 28.3 < target: 50.
    assert ids(policy.order_waiting(waiting, 0.0)) == ["1", "100", "2", "10", "50"]
    # A running batch of short requests makes it start with the longest.
    running = [req("r", 3)]
    assert ids(policy.order_waiting(waiting, 0.0, running))[0] == "100"


def test_priority_orders_by_value_then_deadline_then_arrival():
    policy = make_policy("priority", EngineConfig())
    waiting = [
        req("low", priority=5),
        req("high-late", priority=-1, arrival=2.0),
        req("high", priority=-1, arrival=1.0),
        req("mid-deadline", priority=0, arrival=3.0, deadline=10.0),
        req("mid", priority=0, arrival=0.5),
    ]
    assert ids(policy.order_waiting(waiting, 3.0)) == [
        "high",
        "high-late",
        "mid-deadline",
        "mid",
        "low",
    ]


def test_priority_arrival_preempts_the_lowest_priority_running_request_and_finishes_first():
    clock = Clock()
    sched = make_scheduler(clock, scheduler="priority", max_num_seqs=2)
    sched.add_request(req("mid", 20, priority=1))
    sched.add_request(req("low", 20, priority=2))
    step(sched)
    step(sched)
    urgent = req("urgent", 5, priority=0, arrival=0.0)
    sched.add_request(urgent)
    out = step(sched)
    assert out.preempted_request_ids == ["low"]
    assert ids(out.scheduled) == ["mid", "urgent"]
    assert run_to_end(sched) == ["urgent", "mid", "low"]
    assert sched.num_preemptions == 1


def test_priority_preempts_when_the_kv_cache_is_full_but_seats_are_free():
    # 4 blocks of 8: two 16-token prompts fill the cache; 6 seats stay free.
    sched = make_scheduler(scheduler="priority", num_kv_blocks=4)
    sched.add_request(req("a", 8, prompt=15, priority=1))
    sched.add_request(req("b", 8, prompt=15, priority=3))
    step(sched)
    sched.add_request(req("c", 4, prompt=8, priority=2))
    out = step(sched)
    assert out.preempted_request_ids == ["b"]
    assert ids(out.scheduled) == ["a", "c"]


def test_equal_priorities_never_preempt_each_other():
    sched = make_scheduler(scheduler="priority", max_num_seqs=1)
    sched.add_request(req("first", 6, priority=1))
    step(sched)
    sched.add_request(req("second", 2, priority=1))
    assert run_to_end(sched) == ["first", "second"]
    assert sched.num_preemptions == 0


def test_preemptive_sjf_displaces_the_longest_running_request_after_its_cooldown():
    clock = Clock()
    sched = make_scheduler(
        clock, scheduler="preemptive-sjf", max_num_seqs=2, preemption_cooldown_s=1.0
    )
    sched.add_request(req("long", 40))
    sched.add_request(req("mid", 30))
    step(sched)
    sched.add_request(req("short", 3, arrival=0.0))
    clock.now = 0.5  # both joined at t = 0: still cooling down
    out = step(sched)
    assert out.preempted_request_ids == [] and "short" not in out.num_scheduled_tokens
    clock.now = 1.0
    out = step(sched)
    assert out.preempted_request_ids == ["long"]  # the most remaining work
    assert ids(out.scheduled) == ["mid", "short"]
    assert ids(sched.waiting) == ["long"]
    # long resumes when short ends, recomputing its prompt and the 3 tokens it had.
    order = run_to_end(sched, clock, dt=0.01)
    assert order == ["short", "mid", "long"]
    assert sched.num_preemptions == 1


@pytest.mark.parametrize(
    ("short_len", "threshold", "preempts"),
    [(29, 0.5, True), (30, 0.5, False), (30, 0.6, True), (39, 1.0, False)],
)
def test_preemptive_sjf_threshold_decides_what_is_short_enough(short_len, threshold, preempts):
    clock = Clock()
    sched = make_scheduler(
        clock,
        scheduler="preemptive-sjf",
        max_num_seqs=2,
        preemption_cooldown_s=0.0,
        preemption_threshold=threshold,
    )
    sched.add_request(req("a", 40))
    sched.add_request(req("b", 60))
    step(sched)  # remaining: a 39, b 59
    sched.add_request(req("c", short_len))
    out = step(sched)
    # c preempts b iff c <= threshold * 59 and c would end before a does by itself (39 left).
    assert out.preempted_request_ids == (["b"] if preempts else [])


def test_preemptive_sjf_never_preempts_an_overdue_request():
    clock = Clock()
    sched = make_scheduler(clock, scheduler="preemptive-sjf", max_num_seqs=1, aging_bound_s=2.0)
    sched.add_request(req("long", 40))
    step(sched)
    clock.now = 2.0  # long is now overdue (age 2 >= bound)
    sched.add_request(req("short", 2, arrival=2.0))
    assert step(sched).preempted_request_ids == []


def test_static_batch_admits_together_and_nobody_joins_until_the_last_member_ends():
    # Budget 10: three 6-token prompts take two steps to admit; the batch is still filling.
    sched = make_scheduler(scheduler="static", max_num_seqs=3, max_num_batched_tokens=10)
    for rid, n in (("a", 2), ("b", 5), ("c", 3)):
        sched.add_request(req(rid, n, prompt=6))
    out1 = step(sched)
    assert out1.num_scheduled_tokens == {"a": 6, "b": 4}
    sched.add_request(req("late", 1, prompt=2))
    out2 = step(sched)
    assert out2.num_scheduled_tokens == {"a": 1, "b": 2, "c": 6}  # c joins its own batch
    batches = [ids(step(sched).scheduled) for _ in range(5)]
    # a ends in step 2, c in step 4, b (first token in step 2) in step 6; late waits for all.
    assert batches == [["b", "c"], ["b", "c"], ["b"], ["b"], ["late"]]


def test_deadline_aborts_waiting_and_running_requests_and_frees_blocks():
    clock = Clock()
    sched = make_scheduler(clock, max_num_seqs=2)
    run = req("run", 50, prompt=20, deadline=3.0)
    other = req("other", 6, prompt=20)
    wait = req("wait", 4, deadline=2.0)
    for r in (run, other, wait):
        sched.add_request(r)
    step(sched)
    assert sched.block_manager.num_free_blocks == 64 - 6
    clock.now = 2.0  # the waiting one is due (at its deadline, not after)
    out = step(sched)
    assert wait.status is SequenceStatus.FINISHED_ABORTED
    assert wait.abort_reason.startswith("deadline exceeded")
    assert "wait" in out.finished_request_ids and "wait" not in out.num_scheduled_tokens
    clock.now = 3.5
    out = step(sched)
    assert run.status.finish_reason == "abort" and run.abort_reason.startswith("deadline")
    assert out.finished_request_ids == ["run"]
    assert sched.block_manager.get_block_table("run") == []
    assert sched.block_manager.num_free_blocks == 64 - 3  # only other's 3 blocks are held
    assert len(run.output_token_ids) == 2
    assert run_to_end(sched) == ["other"]
    assert other.status is SequenceStatus.FINISHED_LENGTH
    assert other.output_token_ids == [TOKEN] * 6 and other.abort_reason is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(aging_bound_s=0), "aging_bound_s"),
        (dict(aging_bound_s=float("nan")), "aging_bound_s"),
        (dict(preemption_threshold=0), "preemption_threshold"),
        (dict(preemption_threshold=1.5), "preemption_threshold"),
        (dict(preemption_cooldown_s=-1), "preemption_cooldown_s"),
        (dict(preemption_cooldown_s="1"), "preemption_cooldown_s"),
    ],
)
def test_policy_knobs_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(deadline=0), "deadline"),
        (dict(deadline=float("inf")), "deadline"),
        (dict(deadline="soon"), "deadline"),
        (dict(length_hint=0), "length_hint"),
        (dict(length_hint=2.5), "length_hint"),
    ],
)
def test_scheduling_fields_of_sampling_params_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)

"""The sjf family's indexed admission (conveyor.core.rank_index) gives exactly the order its
sorting definition (`order_waiting`) gives, and the scheduler's WaitingQueue keeps queue
order under removals from anywhere."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.config import EngineConfig
from conveyor.core.policies import make_policy
from conveyor.core.rank_index import remaining
from conveyor.core.sequence import Sequence, SequenceStatus
from conveyor.core.waiting_queue import WaitingQueue
from conveyor.sampling_params import SamplingParams

# One operation: ("add", arrival step, max_tokens, length_hint, deadline, outputs, front),
# ("remove", which waiting one), ("admit", how many candidates), ("tick", seconds).
_add = st.tuples(
    st.just("add"),
    st.integers(0, 3),  # arrivals repeat: ties on arrival are the interesting case
    st.integers(1, 12),
    st.one_of(st.none(), st.integers(1, 12)),
    st.one_of(st.none(), st.sampled_from([5.0, 30.0])),
    st.integers(0, 6),  # output tokens already made (a preempted request)
    st.booleans(),  # re-queued at the front (preempted) or the back (new)
)
_ops = st.lists(
    st.one_of(
        _add,
        st.tuples(st.just("remove"), st.integers(0, 50)),
        st.tuples(st.just("admit"), st.integers(0, 6)),
        st.tuples(st.just("tick"), st.sampled_from([0.5, 2.0, 7.0])),
    ),
    max_size=60,
)


def _request(rid: str, arrival: float, max_tokens: int, hint, deadline, outputs: int) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, length_hint=hint, deadline=deadline)
    seq = Sequence(rid, [1, 2, 3], params, max_tokens=max_tokens, arrival_time=arrival)
    for _ in range(min(outputs, max_tokens - 1)):
        seq.append_output_token(5)
    return seq


@pytest.mark.parametrize("bound", [10.0, math.inf])
@pytest.mark.parametrize("name", ["sjf", "preemptive-sjf", "length-aware"])
@settings(max_examples=60, deadline=None)
@given(ops=_ops, running_rems=st.lists(st.integers(1, 12), max_size=3))
def test_indexed_candidates_equal_the_sorted_order(name, bound, ops, running_rems):
    config = EngineConfig(scheduler=name, aging_bound_s=bound, max_num_seqs=8)
    indexed, reference = make_policy(name, config), make_policy(name, config)
    running = [_request(f"run{i}", 0.0, r, None, None, 0) for i, r in enumerate(running_rems)]
    queue, now = WaitingQueue(), 1.0
    for n, op in enumerate(ops):
        if op[0] == "add":
            _, step, max_tokens, hint, deadline, outputs, front = op
            req = _request(f"r{n}", now - 0.25 * step, max_tokens, hint, deadline, outputs)
            req.status = SequenceStatus.PREEMPTED if front else SequenceStatus.WAITING
            indexed.on_enqueue(req, queue.appendleft(req) if front else queue.append(req))
        elif op[0] == "remove" and queue:
            req = list(queue)[op[1] % len(queue)]
            queue.remove(req)
            indexed.on_dequeue(req)
        elif op[0] == "admit":
            want = reference.order_waiting(list(queue), now, running)
            got = indexed.admission_candidates(list(queue), now, running, op[1])
            assert [r.request_id for r in got] == [r.request_id for r in want[: op[1]]]
        elif op[0] == "tick":
            now += op[1]
    want = reference.order_waiting(list(queue), now, running)
    got = indexed.admission_candidates(list(queue), now, running, len(queue))
    assert [r.request_id for r in got] == [r.request_id for r in want]
    if queue:
        assert indexed._index.min_remaining() == min(map(remaining, queue))
        assert indexed._index.total_remaining == sum(map(remaining, queue))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["back", "front", "remove"]), st.integers(0, 30))))
def test_waiting_queue_keeps_queue_order_under_any_removal(ops):
    queue, model = WaitingQueue(), []
    for n, (op, k) in enumerate(ops):
        if op == "remove":
            if model:
                queue.remove(model.pop(k % len(model)))
            continue
        req = Sequence(f"r{n}", [1], SamplingParams(max_tokens=1), max_tokens=1)
        if op == "back":
            queue.append(req)
            model.append(req)
        else:
            queue.appendleft(req)
            model.insert(0, req)
        assert req in queue
    assert list(queue) == model and len(queue) == len(model) and bool(queue) == bool(model)
    if model:
        with pytest.raises(ValueError, match="already waiting"):
            queue.append(model[0])

"""The shortest-job-first family: sjf, preemptive-sjf and length-aware.

A job's size is its expected remaining output, in decode steps:

    remaining(r) = max(1, expected_output_tokens - num_output_tokens)

where `expected_output_tokens` is the request's `length_hint` or else its `max_tokens`. Prompt
tokens are left out: a prompt takes one step (or a few chunks), each output token one step.

Aging (why plain SJF's "may starve long requests" does not happen here): a waiting request's
rank is its remaining work scaled down linearly with its age,

    effective(r) = remaining(r) * max(0, 1 - (now - arrival) / aging_bound_s)

so after `aging_bound_s` it is 0, the best possible rank: no later arrival overtakes it any
more (it is "overdue"), and among overdue requests the earliest deadline, then the earliest
arrival, goes first. Ties of `effective` are broken by earliest deadline (EDF), then arrival.
preemptive-sjf never preempts an overdue request either, so the bound also holds for requests
that were already running.
"""

from __future__ import annotations

import itertools
import math
from collections import abc
from collections.abc import Callable

from conveyor.core.block_manager import BlockManager
from conveyor.core.policy_base import PolicyKnobs, SchedulingPolicy
from conveyor.core.rank_index import RankIndex, remaining
from conveyor.core.sequence import Sequence

__all__ = ["LengthAwarePolicy", "PreemptiveSjfPolicy", "SjfPolicy", "remaining"]


class SjfPolicy(SchedulingPolicy):
    """Shortest expected remaining output first, with aging (see the module docstring).

    `order_waiting` sorts the queue and is the definition; with a scheduler feeding
    on_enqueue / on_dequeue, admission reads the same order from a RankIndex instead
    (conveyor.core.rank_index) at a cost that does not grow with the queue.
    """

    name = "sjf"

    def __init__(self, knobs: PolicyKnobs, block_manager: BlockManager | None = None) -> None:
        super().__init__(knobs, block_manager)
        self.aging_bound_s = knobs.aging_bound_s
        self._index: RankIndex | None = None

    def _new_index(self) -> RankIndex:
        # In a bucket (one remaining length) rank grows with arrival while aging runs; with
        # aging off it is the remaining length itself, so deadline and arrival decide.
        aging = self.aging_bound_s != math.inf
        in_bucket = _arrival_deadline if aging else _deadline_arrival
        return RankIndex(in_bucket, _deadline_arrival, self.aging_bound_s)

    def on_enqueue(self, req: Sequence, pos: int) -> None:
        if self._index is None:
            self._index = self._new_index()
        self._index.add(req, pos)

    def on_dequeue(self, req: Sequence) -> None:
        if self._index is not None:
            self._index.remove(req)

    def admission_candidates(
        self,
        waiting: abc.Sequence[Sequence],
        now: float,
        running: abc.Sequence[Sequence],
        limit: int,
    ) -> abc.Sequence[Sequence]:
        index = self._index
        if index is None:
            return self.order_waiting(waiting, now, running)
        out, limit = _overdue_first(index, now, limit)
        if len(out) < limit:
            out.extend(itertools.islice(index.merged(self.rank_key(now)), limit - len(out)))
        return out

    def rank_key(self, now: float) -> Callable[[Sequence], tuple[float, float, float]]:
        """The sort key of waiting requests at time `now`: (effective, deadline, arrival).

        Inlined arithmetic: this runs for every waiting request on every admitting step.
        """
        bound = self.aging_bound_s

        def key(r: Sequence) -> tuple[float, float, float]:
            age = now - r.arrival_time
            if age >= bound:
                return (0.0, r.deadline_at, r.arrival_time)
            hint = r.sampling_params.length_hint
            cap = r.max_tokens
            rem = (cap if hint is None or hint > cap else hint) - len(r.output_token_ids)
            rem = 1 if rem < 1 else rem
            if age > 0:
                rem *= 1.0 - age / bound  # bound = inf: 1.0
            return (rem, r.deadline_at, r.arrival_time)

        return key

    def order_waiting(
        self, waiting: abc.Sequence[Sequence], now: float, running: abc.Sequence[Sequence] = ()
    ) -> list[Sequence]:
        return sorted(waiting, key=self.rank_key(now))


class PreemptiveSjfPolicy(SjfPolicy):
    """sjf, and a much shorter waiting request displaces the longest running one.

    When the batch or the KV cache is full, the waiting requests (in sjf order) take the
    places of the running requests with the most remaining work, while
    `remaining(waiting) <= preemption_threshold * remaining(running)` and the waiting one
    would be done before any running request ends by itself (else it is cheaper to wait for
    that seat: simulations showed preempting for it only queues victims). Never chosen: a request
    that joined the batch less than `preemption_cooldown_s` ago (so every victim has run for a
    while since its previous preemption: no thrash), and an overdue one (aging).
    """

    name = "preemptive-sjf"

    def __init__(self, knobs: PolicyKnobs, block_manager: BlockManager | None = None) -> None:
        super().__init__(knobs, block_manager)
        self.threshold = knobs.preemption_threshold
        self.cooldown_s = knobs.preemption_cooldown_s

    def select_preemptions(
        self, running: abc.Sequence[Sequence], waiting: abc.Sequence[Sequence], now: float
    ) -> list[Sequence]:
        cooldown, bound = self.cooldown_s, self.aging_bound_s
        victims = [
            r
            for r in reversed(running)  # among equals, the most recently admitted goes first
            if now - r.arrival_time < bound
            and (r.admitted_at is None or now - r.admitted_at >= cooldown)
        ]
        if not victims:
            return []
        victims.sort(key=remaining, reverse=True)
        threshold = self.threshold
        # A seat frees by itself when the first running request ends: a candidate that would
        # not be done by then gains little from preempting anyone, so it waits instead.
        soonest = min(map(remaining, running))
        index = self._index
        shortest = min(map(remaining, waiting)) if index is None else index.min_remaining()
        if shortest >= soonest or shortest > threshold * remaining(victims[0]):
            return []  # the common case, in O(running)
        # _plan_preemptions takes a candidate only for a seat (a free one or a victim's) and
        # stops at the first that finds none, so it reads at most seats + victims + 1.
        seats = max(0, self.max_num_seqs - len(running))
        candidates = self.admission_candidates(waiting, now, running, seats + len(victims) + 1)
        return self._plan_preemptions(
            candidates,
            victims,
            running,
            lambda c, v: remaining(c) < soonest and remaining(c) <= threshold * remaining(v),
        )


class LengthAwarePolicy(SjfPolicy):
    """Keeps a mix of short and long requests in the batch (see docs/scheduling.md).

    The target is the mean remaining length of every request in the system (running and
    waiting). Each seat goes to the shortest waiting request while the batch's mean remaining
    length is above the target (or the batch is empty), else to the longest one; then the
    batch's mean is updated as if it had been admitted. Overdue requests (older than
    `aging_bound_s`) go first, in arrival order, so a middle-length one cannot starve either.
    """

    name = "length-aware"

    def _new_index(self) -> RankIndex:
        return RankIndex(_deadline_arrival, _arrival_deadline, self.aging_bound_s)

    def admission_candidates(
        self,
        waiting: abc.Sequence[Sequence],
        now: float,
        running: abc.Sequence[Sequence],
        limit: int,
    ) -> abc.Sequence[Sequence]:
        """order_waiting's first `limit`, from the index: the same sums and the same picks,
        with the shortest and longest ends walked from the buckets instead of a sorted list."""
        index = self._index
        if index is None:
            return self.order_waiting(waiting, now, running)
        out, limit = _overdue_first(index, now, limit)
        rest_n = len(index) - len(index.overdue)
        if len(out) >= limit or not rest_n:
            return out
        batch_sum = sum(map(remaining, running)) + index.overdue_remaining
        batch_n = len(running) + len(index.overdue)
        target = (batch_sum + index.total_remaining - index.overdue_remaining) / (batch_n + rest_n)
        shortest, longest = index.ascending(), index.descending()
        for _ in range(min(limit - len(out), rest_n)):  # the two ends never cross
            leans_long = batch_n == 0 or batch_sum > target * batch_n
            pick = next(shortest) if leans_long else next(longest)
            out.append(pick)
            batch_sum += remaining(pick)
            batch_n += 1
        return out

    def order_waiting(
        self, waiting: abc.Sequence[Sequence], now: float, running: abc.Sequence[Sequence] = ()
    ) -> list[Sequence]:
        bound = self.aging_bound_s
        order = sorted(
            (r for r in waiting if now - r.arrival_time >= bound),
            key=lambda r: (r.arrival_time, r.deadline_at),
        )
        if len(order) == len(waiting):
            return order
        late = {id(r) for r in order}
        rest = [r for r in waiting if id(r) not in late]
        rest.sort(key=lambda r: (remaining(r), r.deadline_at, r.arrival_time))
        in_batch = [*running, *order]
        batch_sum = sum(map(remaining, in_batch))
        batch_n = len(in_batch)
        target = (batch_sum + sum(map(remaining, rest))) / (batch_n + len(rest))
        lo, hi = 0, len(rest) - 1
        while lo <= hi:
            if batch_n == 0 or batch_sum > target * batch_n:  # batch leans long: add a short
                pick, lo = rest[lo], lo + 1
            else:  # batch leans short: add a long one
                pick, hi = rest[hi], hi - 1
            order.append(pick)
            batch_sum += remaining(pick)
            batch_n += 1
        return order


def _overdue_first(index: RankIndex, now: float, limit: int) -> tuple[list[Sequence], int]:
    """The index brought to time `now`, its overdue requests first: (the first `limit` of
    them, limit clamped at 0)."""
    index.promote(now)
    limit = max(limit, 0)
    return [e[-1] for e in index.overdue[:limit]], limit


def _arrival_deadline(r: Sequence) -> tuple[float, float]:
    return (r.arrival_time, r.deadline_at)


def _deadline_arrival(r: Sequence) -> tuple[float, float]:
    return (r.deadline_at, r.arrival_time)

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

from collections import abc
from collections.abc import Callable

from conveyor.core.block_manager import BlockManager
from conveyor.core.policies import SchedulingPolicy, register_policy
from conveyor.core.sequence import Sequence
from conveyor.engine.config import EngineConfig


def remaining(req: Sequence) -> int:
    """Expected remaining output tokens of `req` (at least 1)."""
    return max(1, req.expected_output_tokens - len(req.output_token_ids))


@register_policy
class SjfPolicy(SchedulingPolicy):
    """Shortest expected remaining output first, with aging (see the module docstring)."""

    name = "sjf"

    def __init__(self, config: EngineConfig, block_manager: BlockManager | None = None) -> None:
        super().__init__(config, block_manager)
        self.aging_bound_s = config.aging_bound_s

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


@register_policy
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

    def __init__(self, config: EngineConfig, block_manager: BlockManager | None = None) -> None:
        super().__init__(config, block_manager)
        self.threshold = config.preemption_threshold
        self.cooldown_s = config.preemption_cooldown_s

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
        shortest = min(map(remaining, waiting))
        if shortest >= soonest or shortest > threshold * remaining(victims[0]):
            return []  # the common case, in O(n)
        return self._plan_preemptions(
            self.order_waiting(waiting, now),
            victims,
            running,
            lambda c, v: remaining(c) < soonest and remaining(c) <= threshold * remaining(v),
        )


@register_policy
class LengthAwarePolicy(SjfPolicy):
    """Keeps a mix of short and long requests in the batch (see docs/scheduling.md).

    The target is the mean remaining length of every request in the system (running and
    waiting). Each seat goes to the shortest waiting request while the batch's mean remaining
    length is above the target (or the batch is empty), else to the longest one; then the
    batch's mean is updated as if it had been admitted. Overdue requests (older than
    `aging_bound_s`) go first, in arrival order, so a middle-length one cannot starve either.
    """

    name = "length-aware"

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

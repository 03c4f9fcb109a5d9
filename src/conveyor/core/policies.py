"""Scheduling policies: which waiting request goes first and which running one yields.

The scheduler owns the mechanics (token budget, blocks, chunking, preemption by recompute,
deadlines); a policy only makes the choices. A new policy is one class and one line in
`BUILTIN_POLICIES` (at the bottom; `EngineConfig` checks a name against `available_policies()`):

    class ShortestPromptFirst(SchedulingPolicy):
        name = "shortest-prompt"

        def order_waiting(self, waiting, now, running=()):
            return sorted(waiting, key=lambda r: (r.num_prompt_tokens, r.arrival_time))

Hooks and their defaults (override only what the policy changes; `SchedulingPolicy` is in
policy_base.py):
    order_waiting      admission order of the waiting queue            (abstract)
    select_victim      whom to preempt when blocks run out             most recently admitted
    may_admit          whether this step admits at all                 always
    select_preemptions running requests to preempt for waiting ones    none

The built-in policies (knobs are EngineConfig fields):
    fifo            arrival order; preempted requests resume first
    sjf             least expected remaining output first (length_hint or max_tokens), with
                    aging: after `aging_bound_s` no later arrival overtakes a request
    preemptive-sjf  sjf, and when the batch or the KV cache is full a waiting request whose
                    remaining output is at most `preemption_threshold` x the longest running
                    one's (and that would end before any running one) preempts it; nobody is
                    preempted within `preemption_cooldown_s` of joining the batch or once
                    overdue                                             (policies_sjf.py)
    length-aware    alternates short and long requests to keep the running batch's mean
                    remaining length near the queue's mean, with sjf's aging (policies_sjf.py)
    priority        lower `priority` value first, then earliest deadline, then arrival; a
                    waiting request preempts strictly lower-priority running ones when the
                    batch or the KV cache is full
    static          the baseline: a batch of up to max_num_seqs requests is formed in arrival
                    order and nobody joins until its last member ends
Preemption is always by recompute, so it does not change a request's output (up to fp32
rounding of near-ties: recompute runs prefill attention where the first pass ran decode).
"""

from __future__ import annotations

import heapq
import itertools
from collections import abc
from collections.abc import Callable
from typing import TypeVar

from conveyor.config import EngineConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.policies_sjf import LengthAwarePolicy, PreemptiveSjfPolicy, SjfPolicy
from conveyor.core.policy_base import PolicyKnobs, SchedulingPolicy
from conveyor.core.sequence import Sequence, SequenceStatus

__all__ = [
    "BUILTIN_POLICIES",
    "FifoPolicy",
    "LengthAwarePolicy",
    "PolicyKnobs",
    "PreemptiveSjfPolicy",
    "PriorityPolicy",
    "SchedulingPolicy",
    "SjfPolicy",
    "StaticBatchPolicy",
    "available_policies",
    "make_policy",
    "priority_key",
    "register_policy",
]


def priority_key(req: Sequence) -> tuple[int, float, float]:
    """Lower sorts first: priority value, then earliest deadline, then arrival."""
    return (req.sampling_params.priority, req.deadline_at, req.arrival_time)


class FifoPolicy(SchedulingPolicy):
    """First come, first served; preempted requests resume first (they are at the front)."""

    name = "fifo"

    def order_waiting(
        self, waiting: abc.Sequence[Sequence], now: float, running: abc.Sequence[Sequence] = ()
    ) -> list[Sequence]:
        return list(waiting)

    def admission_candidates(
        self,
        waiting: abc.Sequence[Sequence],
        now: float,
        running: abc.Sequence[Sequence],
        limit: int,
    ) -> abc.Sequence[Sequence]:
        return list(itertools.islice(waiting, max(limit, 0)))


_WAITING_STATES = (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)


class _KeyedQueue:
    """The scheduler's waiting queue indexed by a key that does not change while a request
    waits: a heap of (key, queue position, request), removed lazily.

    An entry is live while its request is still waiting (status WAITING or PREEMPTED) and
    it is the request's latest entry (a re-queued request gets a new one). Every request in
    the scheduler's `waiting` has exactly one live entry, so the live entries in heap order
    are `sorted(waiting, key=key)`: the sort is stable and `waiting` is in position order,
    which is the entries' tie-breaker.
    """

    def __init__(self, key: Callable[[Sequence], object]) -> None:
        self.key = key
        self.heap: list[tuple[object, int, Sequence]] = []
        self.latest: dict[str, int] = {}

    def push(self, req: Sequence, pos: int) -> None:
        self.latest[req.request_id] = pos
        heapq.heappush(self.heap, (self.key(req), pos, req))
        if len(self.heap) > 2 * len(self.latest) + 64:  # too many dead entries: compact
            self.heap = [e for e in self.heap if self._live(e)]
            heapq.heapify(self.heap)

    def _live(self, entry: tuple[object, int, Sequence]) -> bool:
        req = entry[2]
        return req.status in _WAITING_STATES and self.latest.get(req.request_id) == entry[1]

    def head(self, k: int) -> list[Sequence]:
        """The first `k` waiting requests in key order, O(k log n) plus dead entries."""
        heap, out = self.heap, []
        while heap and len(out) < k:
            entry = heapq.heappop(heap)
            if self._live(entry):
                out.append(entry)
            elif self.latest.get(entry[2].request_id) == entry[1]:
                del self.latest[entry[2].request_id]  # its request left the queue
        for entry in out:
            heapq.heappush(heap, entry)
        return [e[2] for e in out]


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` value first (ties: earliest deadline, then arrival).

    Unlike vLLM (vllm#40004), a waiting request also displaces running requests of strictly
    lower priority (higher value) when the batch or the KV cache is full; equal priorities
    never preempt each other, so there is no thrash. Blocks running out preempt the
    lowest-priority running request too.
    """

    name = "priority"

    def __init__(self, knobs: PolicyKnobs, block_manager: BlockManager | None = None) -> None:
        super().__init__(knobs, block_manager)
        # Fed by the scheduler (on_enqueue); None while the policy is used on its own.
        self._queue: _KeyedQueue | None = None

    def on_enqueue(self, req: Sequence, pos: int) -> None:
        if self._queue is None:
            self._queue = _KeyedQueue(priority_key)
        self._queue.push(req, pos)

    def admission_candidates(
        self,
        waiting: abc.Sequence[Sequence],
        now: float,
        running: abc.Sequence[Sequence],
        limit: int,
    ) -> abc.Sequence[Sequence]:
        if self._queue is None:
            return self.order_waiting(waiting, now, running)
        return self._queue.head(max(limit, 0))

    def order_waiting(
        self, waiting: abc.Sequence[Sequence], now: float, running: abc.Sequence[Sequence] = ()
    ) -> list[Sequence]:
        return sorted(waiting, key=priority_key)

    def select_victim(self, running: list[Sequence]) -> Sequence:
        # Reversed: among equal keys, the most recently admitted yields.
        return max(reversed(running), key=priority_key)

    def select_preemptions(
        self, running: abc.Sequence[Sequence], waiting: abc.Sequence[Sequence], now: float
    ) -> list[Sequence]:
        queue = self._queue
        if queue is None:
            best = min(r.sampling_params.priority for r in waiting)
        else:  # the head of priority order has the smallest priority value
            best = queue.head(1)[0].sampling_params.priority
        if best >= max(r.sampling_params.priority for r in running):
            return []  # Nobody waiting outranks anybody running: the common case.
        victims = sorted(reversed(running), key=priority_key, reverse=True)
        if queue is None:
            candidates = self.order_waiting(waiting, now)
        else:
            # _plan_preemptions passes a candidate only for a seat, and there are at most
            # max_num_seqs seats (free ones plus every running victim); it stops at the next
            # candidate, so it never reads past the first max_num_seqs + 1.
            candidates = queue.head(self.max_num_seqs + 1)
        return self._plan_preemptions(
            candidates, victims, running, lambda c, v: c.priority < v.priority
        )


class StaticBatchPolicy(SchedulingPolicy):
    """The baseline: a fixed batch is admitted together; nobody joins until it has ended.

    When nothing of the previous batch is left, the first `max_num_seqs` waiting requests (in
    queue order) become the batch. Only its members are admitted (over several steps if the
    token budget or the blocks say so), and the batch ends when its last member finishes.
    """

    name = "static"

    def __init__(self, knobs: PolicyKnobs, block_manager: BlockManager | None = None) -> None:
        super().__init__(knobs, block_manager)
        self._batch: list[Sequence] = []

    def _batch_over(self) -> bool:
        return all(r.is_finished for r in self._batch)

    def may_admit(self, running: abc.Sequence[Sequence]) -> bool:
        # Admit while the batch is over (a new one forms) or members still wait for a seat.
        waiting = (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
        return self._batch_over() or any(r.status in waiting for r in self._batch)

    def order_waiting(
        self, waiting: abc.Sequence[Sequence], now: float, running: abc.Sequence[Sequence] = ()
    ) -> list[Sequence]:
        if self._batch_over():
            self._batch = list(waiting)[: self.max_num_seqs]
            return list(self._batch)
        members = {id(r) for r in self._batch}
        return [r for r in waiting if id(r) in members]


# Every built-in policy, by class: the one list a new policy joins (the SJF family lives in
# its own module, one noun per module).
BUILTIN_POLICIES: tuple[type[SchedulingPolicy], ...] = (
    FifoPolicy,
    SjfPolicy,
    PreemptiveSjfPolicy,
    LengthAwarePolicy,
    PriorityPolicy,
    StaticBatchPolicy,
)

# Name -> class: the built-in policies, and those `register_policy` adds at run time.
_POLICIES: dict[str, type[SchedulingPolicy]] = {cls.name: cls for cls in BUILTIN_POLICIES}

P = TypeVar("P", bound=type[SchedulingPolicy])


def register_policy(cls: P) -> P:
    """Make a policy defined elsewhere (a plugin, a test) available under `cls.name`.

    Usable as a class decorator. The built-in policies are listed in `BUILTIN_POLICIES`.
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} must set a non-empty class attribute `name`.")
    if name in _POLICIES and _POLICIES[name] is not cls:
        raise ValueError(f"scheduling policy {name!r} is already registered.")
    _POLICIES[name] = cls
    return cls


def available_policies() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_POLICIES)


def make_policy(
    name: str, config: EngineConfig | PolicyKnobs, block_manager: BlockManager | None = None
) -> SchedulingPolicy:
    """Build the policy registered as `name`.

    Args:
        name: a registered policy name (`available_policies()`).
        config: the engine config (or PolicyKnobs): the policy gets its `PolicyKnobs`.
        block_manager: the scheduler's KV blocks, for policies that preempt when it is full.
    Raises:
        ValueError: no policy has that name (the message lists the registered ones).
    """
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(
            f"unknown scheduler {name!r}; choose one of: {', '.join(available_policies())}."
        )
    knobs = config if isinstance(config, PolicyKnobs) else PolicyKnobs.of(config)
    return cls(knobs, block_manager)

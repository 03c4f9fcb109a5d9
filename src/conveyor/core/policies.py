"""Scheduling policies: which waiting request goes first and which running one yields.

The scheduler owns the mechanics (token budget, blocks, chunking, preemption by recompute,
deadlines); a policy only makes the choices. A new policy is one class and one registry line:

    @register_policy
    class ShortestPromptFirst(SchedulingPolicy):
        name = "shortest-prompt"

        def order_waiting(self, waiting, now, running=()):
            return sorted(waiting, key=lambda r: (r.num_prompt_tokens, r.arrival_time))

Hooks and their defaults (override only what the policy changes):
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
import math
from abc import ABC, abstractmethod
from collections import abc
from collections.abc import Callable
from typing import ClassVar, TypeVar

from conveyor.core.block_manager import BlockManager
from conveyor.core.sequence import Sequence, SequenceStatus
from conveyor.engine.config import EngineConfig


class SchedulingPolicy(ABC):
    """Choices the scheduler delegates; stateless unless a policy needs state."""

    name: ClassVar[str]

    def __init__(self, config: EngineConfig, block_manager: BlockManager | None = None) -> None:
        """Args:
        config: the engine config; a policy copies the knobs it needs.
        block_manager: the scheduler's KV blocks (read-only here), so that preemptive
            policies can tell a full cache; None when the policy is used on its own.
        """
        self.max_num_seqs = config.max_num_seqs
        self.block_manager = block_manager

    @abstractmethod
    def order_waiting(
        self, waiting: abc.Sequence[Sequence], now: float, running: abc.Sequence[Sequence] = ()
    ) -> list[Sequence]:
        """Admission order of the waiting requests.

        Preempted requests are re-queued at the front of `waiting` by the scheduler; a
        policy that keeps queue order therefore resumes them first.

        Args:
            waiting: the waiting queue in queue order (do not mutate).
            now: the scheduler clock of this step, for age- and deadline-based policies.
            running: the running requests (admission order), for batch-aware policies.
        Returns:
            The requests to try to admit, in order; the scheduler stops at the first one
            that does not fit. Requests left out stay waiting.
        """

    def admission_candidates(
        self,
        waiting: abc.Sequence[Sequence],
        now: float,
        running: abc.Sequence[Sequence],
        limit: int,
    ) -> abc.Sequence[Sequence]:
        """At least the first `limit` requests of `order_waiting` (all, if fewer), in order.

        What the scheduler admits from; it never looks past the first `limit`. Policies
        override it to avoid ordering the whole queue every step.
        """
        return self.order_waiting(waiting, now, running)

    def on_enqueue(self, req: Sequence, pos: int) -> None:
        """The scheduler put `req` into `waiting` (at queue position `pos`).

        Positions are unique and the waiting queue is always in ascending position order,
        so a policy may keep its own index of the queue. Ignored by default.
        """
        del req, pos

    def on_dequeue(self, req: Sequence) -> None:
        """`req` left `waiting` (admitted, or finished while waiting). Ignored by default."""
        del req

    def select_victim(self, running: list[Sequence]) -> Sequence:
        """The running request to preempt (recompute) when blocks run out.

        Args:
            running: the running requests in admission order, never empty.
        Returns:
            One element of `running`; by default the most recently admitted.
        """
        return running[-1]

    def may_admit(self, running: abc.Sequence[Sequence]) -> bool:
        """Whether this step may admit waiting requests at all (asked once per step).

        A static-batching baseline returns False while its batch runs.
        """
        return True

    def select_preemptions(
        self, running: abc.Sequence[Sequence], waiting: abc.Sequence[Sequence], now: float
    ) -> list[Sequence]:
        """Running requests to preempt at the start of a step so waiting ones can run.

        Used by preemptive policies (a short job displacing a long one). Unlike preemption
        for lack of blocks, these do not stop the step from admitting new requests.
        Called only while requests are waiting and running.

        Returns:
            Elements of `running` to preempt; none by default.
        """
        return []

    def _plan_preemptions(
        self,
        candidates: abc.Sequence[Sequence],
        victims: abc.Sequence[Sequence],
        running: abc.Sequence[Sequence],
        outranks: Callable[[Sequence, Sequence], bool],
    ) -> list[Sequence]:
        """Victims to preempt so that the candidates, in order, find a seat and KV blocks.

        Walks the candidates (the admission order) while each still fits: a free seat
        (`max_num_seqs`) and enough free blocks for its known tokens. One that does not fit
        takes victims, worst first, while it `outranks` them; if it still does not fit, the
        plan stops there (admission is in order: nobody behind it may pass).

        Blocks are estimated: free blocks, less what the running requests need to cover their
        known tokens this step, plus what each victim gives back.

        Args:
            candidates: waiting requests in admission order.
            victims: running requests that may be preempted, worst first.
            running: all running requests.
            outranks: (candidate, victim) -> whether the candidate may displace the victim.
        Returns:
            The victims to preempt, a prefix of `victims`.
        """
        bm = self.block_manager

        def held(r: Sequence) -> int:
            return 0 if bm is None else len(bm.block_tables.get(r.request_id, ()))

        def growth(r: Sequence) -> int:  # blocks r still needs to cover its known tokens
            return 0 if bm is None else max(0, bm.num_blocks_for(r.num_tokens) - held(r))

        seats = self.max_num_seqs - len(running)
        free = math.inf if bm is None else bm.num_free_blocks - sum(map(growth, running))
        chosen: list[Sequence] = []
        v = 0
        for cand in candidates:
            need = 0 if bm is None else bm.num_blocks_for(cand.num_tokens)
            s, f, j = seats, free, v
            while (s < 1 or f < need) and j < len(victims) and outranks(cand, victims[j]):
                s += 1
                f += held(victims[j]) + growth(victims[j])
                j += 1
            if s < 1 or f < need:
                break
            chosen.extend(victims[v:j])
            seats, free, v = s - 1, f - need, j
        return chosen


_POLICIES: dict[str, type[SchedulingPolicy]] = {}

P = TypeVar("P", bound=type[SchedulingPolicy])


def register_policy(cls: P) -> P:
    """Class decorator: make a policy available to `make_policy` under `cls.name`."""
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
    name: str, config: EngineConfig, block_manager: BlockManager | None = None
) -> SchedulingPolicy:
    """Build the policy registered as `name`.

    Args:
        name: a registered policy name (`available_policies()`).
        config: the engine config, for the policy's knobs.
        block_manager: the scheduler's KV blocks, for policies that preempt when it is full.
    Raises:
        ValueError: no policy has that name (the message lists the registered ones).
    """
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(
            f"unknown scheduler {name!r}; choose one of: {', '.join(available_policies())}."
        )
    return cls(config, block_manager)


def priority_key(req: Sequence) -> tuple[int, float, float]:
    """Lower sorts first: priority value, then earliest deadline, then arrival."""
    return (req.sampling_params.priority, req.deadline_at, req.arrival_time)


@register_policy
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


@register_policy
class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` value first (ties: earliest deadline, then arrival).

    Unlike vLLM (vllm#40004), a waiting request also displaces running requests of strictly
    lower priority (higher value) when the batch or the KV cache is full; equal priorities
    never preempt each other, so there is no thrash. Blocks running out preempt the
    lowest-priority running request too.
    """

    name = "priority"

    def __init__(self, config: EngineConfig, block_manager: BlockManager | None = None) -> None:
        super().__init__(config, block_manager)
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


@register_policy
class StaticBatchPolicy(SchedulingPolicy):
    """The baseline: a fixed batch is admitted together; nobody joins until it has ended.

    When nothing of the previous batch is left, the first `max_num_seqs` waiting requests (in
    queue order) become the batch. Only its members are admitted (over several steps if the
    token budget or the blocks say so), and the batch ends when its last member finishes.
    """

    name = "static"

    def __init__(self, config: EngineConfig, block_manager: BlockManager | None = None) -> None:
        super().__init__(config, block_manager)
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


# The SJF family lives in its own module (one noun per module); importing it registers it.
from conveyor.core import policies_sjf as _policies_sjf  # noqa: E402,F401

"""The base class of the scheduling policies: the choices the scheduler delegates.

Its own module so that every policy module (policies.py, policies_sjf.py) imports it, and
policies.py imports them all to list them in `BUILTIN_POLICIES`, without an import cycle.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import ClassVar

from conveyor.config import EngineConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.long_prefills import is_long_prefill
from conveyor.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PolicyKnobs:
    """The settings a policy reads: the EngineConfig fields of the same names."""

    max_num_seqs: int
    aging_bound_s: float
    preemption_threshold: float
    preemption_cooldown_s: float
    # The long-prefill rule's limits (core/long_prefills.py), so that preemption plans for the
    # requests admission will take (core/admission.py passes some long prompts over).
    long_prefill_token_threshold: int
    max_long_partial_prefills: int
    # ... and the prompts a step may leave unfinished (admission passes more over).
    max_num_partial_prefills: int
    max_num_batched_tokens: int

    @classmethod
    def of(cls, config: EngineConfig) -> PolicyKnobs:
        """The knobs of `config`."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


class SchedulingPolicy(ABC):
    """Choices the scheduler delegates; stateless unless a policy needs state."""

    name: ClassVar[str]

    def __init__(self, knobs: PolicyKnobs, block_manager: BlockManager | None = None) -> None:
        """Args:
        knobs: the settings policies read; a policy copies those it needs.
        block_manager: the scheduler's KV blocks (read-only here), so that preemptive
            policies can tell a full cache; None when the policy is used on its own.
        """
        self.max_num_seqs = knobs.max_num_seqs
        self.long_threshold = knobs.long_prefill_token_threshold
        self.max_long_partial = knobs.max_long_partial_prefills
        self.max_partial = knobs.max_num_partial_prefills
        self.step_budget = knobs.max_num_batched_tokens
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
        plan stops there (admission is in order: nobody behind it may pass). A long prefill
        that admission would pass over (as many in progress as `max_long_partial_prefills`
        allows) is skipped, and so is a prompt longer than a step's budget while as many
        prompts as `max_num_partial_prefills` allows are in progress, its victims aside
        (counting every running prompt not done: a candidate skipped wrongly only waits its
        turn, one preempted for wrongly would let another take its seat and be the next
        victim, a livelock).

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

        threshold = self.long_threshold

        def is_long(r: Sequence) -> bool:  # a long prefill of the chunking rule
            return is_long_prefill(threshold, r)

        seats = self.max_num_seqs - len(running)
        free = math.inf if bm is None else bm.num_free_blocks - sum(map(growth, running))
        longs = sum(map(is_long, running)) if threshold else 0

        def in_progress(r: Sequence) -> bool:  # a prompt (or recompute) not done
            return r.num_tokens - r.num_computed_tokens > 1

        partial = sum(map(in_progress, running))
        chosen: list[Sequence] = []
        v = 0
        for cand in candidates:
            long = is_long(cand)
            if long and longs >= self.max_long_partial:
                # Admission passes it over this step: preempting for it would only free a
                # seat for someone behind it, who may be the next victim (a livelock).
                continue
            unfinished = cand.num_tokens - 1 > self.step_budget  # left so by this step
            need = 0 if bm is None else bm.num_blocks_for(cand.num_tokens)
            s, f, j = seats, free, v
            while (s < 1 or f < need) and j < len(victims) and outranks(cand, victims[j]):
                s += 1
                f += held(victims[j]) + growth(victims[j])
                j += 1
            if s < 1 or f < need:
                break
            freed = sum(map(in_progress, victims[v:j]))
            if unfinished and partial - freed >= self.max_partial:
                continue  # the same, for a prompt this step would leave unfinished
            chosen.extend(victims[v:j])
            seats, free, v = s - 1, f - need, j
            longs += long
            partial += unfinished - freed
        return chosen

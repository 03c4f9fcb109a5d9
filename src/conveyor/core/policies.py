"""Scheduling policies: which waiting request goes first and which running one yields.

The scheduler owns the mechanics (token budget, blocks, chunking, preemption by recompute);
a policy only makes the choices. A new policy is one class and one registry line:

    @register_policy
    class ShortestJobFirst(SchedulingPolicy):
        name = "sjf"

        def order_waiting(self, waiting, now, running=()):
            return sorted(waiting, key=lambda r: (r.num_prompt_tokens, r.arrival_time))

Hooks and their defaults (override only what the policy changes):
    order_waiting      admission order of the waiting queue            (abstract)
    select_victim      whom to preempt when blocks run out             most recently admitted
    may_admit          whether this step admits at all                 always
    select_preemptions running requests to preempt for waiting ones    none
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, TypeVar

from conveyor.config import EngineConfig
from conveyor.core.request import Request


class SchedulingPolicy(ABC):
    """Choices the scheduler delegates; stateless unless a policy needs state."""

    name: ClassVar[str]

    def __init__(self, config: EngineConfig) -> None:
        """Args:
        config: the engine config; a policy copies the knobs it needs.
        """
        self.max_num_seqs = config.max_num_seqs

    @abstractmethod
    def order_waiting(
        self, waiting: Sequence[Request], now: float, running: Sequence[Request] = ()
    ) -> list[Request]:
        """Admission order of the waiting requests.

        Preempted requests are re-queued at the front of `waiting` by the scheduler; a
        policy that keeps queue order therefore resumes them first.

        Args:
            waiting: the waiting queue in queue order (do not mutate).
            now: `time.monotonic()` of this step, for age-based policies.
            running: the running requests (admission order), for batch-aware policies.
        Returns:
            The requests to try to admit, in order; the scheduler stops at the first one
            that does not fit. Requests left out stay waiting.
        """

    def select_victim(self, running: list[Request]) -> Request:
        """The running request to preempt (recompute) when blocks run out.

        Args:
            running: the running requests in admission order, never empty.
        Returns:
            One element of `running`; by default the most recently admitted.
        """
        return running[-1]

    def may_admit(self, running: Sequence[Request]) -> bool:
        """Whether this step may admit waiting requests at all (asked once per step).

        A static-batching baseline returns False while its batch runs.
        """
        return True

    def select_preemptions(
        self, running: Sequence[Request], waiting: Sequence[Request], now: float
    ) -> list[Request]:
        """Running requests to preempt at the start of a step so waiting ones can run.

        Used by preemptive policies (a short job displacing a long one). Unlike preemption
        for lack of blocks, these do not stop the step from admitting new requests.
        Called only while requests are waiting.

        Returns:
            Elements of `running` to preempt; none by default.
        """
        return []


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


def make_policy(name: str, config: EngineConfig) -> SchedulingPolicy:
    """Build the policy registered as `name`.

    Raises:
        ValueError: no policy has that name (the message lists the registered ones).
    """
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(
            f"unknown scheduler {name!r}; choose one of: {', '.join(available_policies())}."
        )
    return cls(config)


@register_policy
class FifoPolicy(SchedulingPolicy):
    """First come, first served; preempted requests resume first (they are at the front)."""

    name = "fifo"

    def order_waiting(
        self, waiting: Sequence[Request], now: float, running: Sequence[Request] = ()
    ) -> list[Request]:
        return list(waiting)

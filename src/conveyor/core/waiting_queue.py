"""The scheduler's waiting queue: queue order, O(1) push at either end and O(1) removal of any
request (a deque needs an O(n) rebuild to drop requests from the middle, which policies that
do not admit in queue order did on every admitting step).

Each request gets a queue position when it joins: the back counts up from 0, the front down
from -1, so iteration in ascending position order is queue order:

    front (preempted, newest first)      back (new arrivals, oldest first)
    pos  -3   -2   -1                     0    1    2
         P3   P2   P1                     A    B    C      -> iterates P3 P2 P1 A B C

Two insertion-ordered dicts hold the two halves (the front one is iterated reversed).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from conveyor.core.sequence import Sequence


class WaitingQueue:
    """Requests waiting to be admitted, in queue order; each request at most once."""

    def __init__(self) -> None:
        self._front: dict[str, Sequence] = {}  # insertion order = descending position
        self._back: dict[str, Sequence] = {}  # insertion order = ascending position
        self._back_pos = itertools.count()
        self._front_pos = itertools.count(1)

    def append(self, req: Sequence) -> int:
        """Queue `req` at the back; returns its position."""
        self._check_new(req)
        self._back[req.request_id] = req
        return next(self._back_pos)

    def appendleft(self, req: Sequence) -> int:
        """Queue `req` at the front; returns its position (below every other)."""
        self._check_new(req)
        self._front[req.request_id] = req
        return -next(self._front_pos)

    def remove(self, req: Sequence) -> None:
        """Take `req` out of the queue (it must be in it)."""
        rid = req.request_id
        if self._front.pop(rid, None) is None:
            del self._back[rid]

    def __contains__(self, req: object) -> bool:
        rid = getattr(req, "request_id", None)
        return rid in self._front or rid in self._back

    def __iter__(self) -> Iterator[Sequence]:
        yield from reversed(self._front.values())
        yield from self._back.values()

    def __len__(self) -> int:
        return len(self._front) + len(self._back)

    def __bool__(self) -> bool:
        return bool(self._front or self._back)

    def _check_new(self, req: Sequence) -> None:
        if req in self:
            raise ValueError(f"request {req.request_id!r} is already waiting.")

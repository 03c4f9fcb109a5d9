"""An index of the waiting queue for the shortest-job-first family (conveyor.core.policies_sjf),
so that a step's admission candidates cost O(distinct lengths + k log), not a sort of the queue.

A waiting request's remaining length does not change while it waits, and neither do its
arrival and deadline. Its sjf rank does change with time (aging: `remaining * (1 - age /
bound)`), but two requests of the SAME remaining length keep their relative order: the one
that arrived first always ranks first. So the index keeps one sorted bucket per remaining
length and merges only the buckets' heads at query time:

    remaining  bucket (sorted by the policy's in-bucket key)
        3      [r7, r2, r9]          head r7 ─┐
        8      [r1]                  head r1 ─┼─► k-way merge by the exact rank at `now`
       40      [r4, r5]              head r4 ─┘
    overdue    [r3, r8]  (age >= bound: rank 0, ahead of every bucket; own order)

Requests move from their bucket to `overdue` when they reach the aging bound (found through
a list sorted by arrival, in O(moved)). Every entry ends with the request's queue position,
which is unique and is the stable sort's tie-breaker, so no two entries ever compare equal.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterator

from conveyor.core.sequence import Sequence

# An entry: (key..., queue position, request); the position makes every entry distinct.
Entry = tuple
KeyFn = Callable[[Sequence], tuple]


def remaining(req: Sequence) -> int:
    """Expected remaining output tokens of `req` (at least 1)."""
    return max(1, req.expected_output_tokens - len(req.output_token_ids))


class RankIndex:
    """The waiting requests of one scheduler, by remaining length (see the module docstring).

    Args:
        bucket_key: in-bucket order (before the queue position), e.g. (arrival, deadline).
        overdue_key: order among overdue requests (before the queue position).
        aging_bound_s: age at which a request becomes overdue (inf: never).
    """

    def __init__(self, bucket_key: KeyFn, overdue_key: KeyFn, aging_bound_s: float) -> None:
        self._bucket_key = bucket_key
        self._overdue_key = overdue_key
        self.bound = aging_bound_s
        self.buckets: dict[int, list[Entry]] = {}
        self.lengths: list[int] = []  # sorted keys of the non-empty buckets
        self.overdue: list[Entry] = []
        self._by_arrival: list[tuple[float, int, Sequence]] = []  # bucketed requests only
        # request id -> (remaining, its entry, whether it is overdue)
        self._where: dict[str, tuple[int, Entry, bool]] = {}
        self._rem_counts: dict[int, int] = {}  # remaining -> waiting requests (overdue too)
        self._rems: list[int] = []  # sorted keys of _rem_counts
        self.total_remaining = 0
        self.overdue_remaining = 0

    def __len__(self) -> int:
        return len(self._where)

    def add(self, req: Sequence, pos: int) -> None:
        """`req` joined the waiting queue at position `pos`."""
        rem = remaining(req)
        entry = (*self._bucket_key(req), pos, req)
        bucket = self.buckets.get(rem)
        if bucket is None:
            bucket = self.buckets[rem] = []
            bisect.insort(self.lengths, rem)
        bisect.insort(bucket, entry)
        bisect.insort(self._by_arrival, (req.arrival_time, pos, req))
        self._where[req.request_id] = (rem, entry, False)
        if rem not in self._rem_counts:
            self._rem_counts[rem] = 0
            bisect.insort(self._rems, rem)
        self._rem_counts[rem] += 1
        self.total_remaining += rem

    def remove(self, req: Sequence) -> None:
        """`req` left the waiting queue (admitted or finished). Unknown requests are ignored."""
        found = self._where.pop(req.request_id, None)
        if found is None:
            return
        rem, entry, overdue = found
        if overdue:
            _discard(self.overdue, entry)
            self.overdue_remaining -= rem
        else:
            self._unbucket(rem, entry)
            _discard(self._by_arrival, (req.arrival_time, entry[-2], req))
        self._rem_counts[rem] -= 1
        if not self._rem_counts[rem]:
            del self._rem_counts[rem]
            _discard(self._rems, rem)
        self.total_remaining -= rem

    def min_remaining(self) -> int:
        """The smallest remaining length among all waiting requests (the index is not empty)."""
        return self._rems[0]

    def promote(self, now: float) -> None:
        """Move every request whose age has reached the bound into `overdue`."""
        arrivals, bound = self._by_arrival, self.bound
        if bound == math.inf:
            return
        moved = 0
        while moved < len(arrivals) and now - arrivals[moved][0] >= bound:
            req = arrivals[moved][2]
            rem, entry, _ = self._where[req.request_id]
            self._unbucket(rem, entry)
            late = (*self._overdue_key(req), entry[-2], req)
            bisect.insort(self.overdue, late)
            self._where[req.request_id] = (rem, late, True)
            self.overdue_remaining += rem
            moved += 1
        del arrivals[:moved]

    def merged(self, rank: Callable[[Sequence], tuple]) -> Iterator[Sequence]:
        """The bucketed (not overdue) requests in `rank` order, lazily: a k-way merge of the
        buckets, valid because `rank` orders each bucket as its in-bucket key does."""
        heads = []
        for rem in self.lengths:
            bucket = self.buckets[rem]
            req = bucket[0][-1]
            heads.append((rank(req), bucket[0][-2], rem, 0))
        heapq.heapify(heads)
        while heads:
            _, _, rem, i = heads[0]
            bucket = self.buckets[rem]
            yield bucket[i][-1]
            if i + 1 < len(bucket):
                nxt = bucket[i + 1]
                heapq.heapreplace(heads, (rank(nxt[-1]), nxt[-2], rem, i + 1))
            else:
                heapq.heappop(heads)

    def ascending(self) -> Iterator[Sequence]:
        """Bucketed requests by (remaining, in-bucket key)."""
        for rem in self.lengths:
            for entry in self.buckets[rem]:
                yield entry[-1]

    def descending(self) -> Iterator[Sequence]:
        """The reverse of `ascending`."""
        for rem in reversed(self.lengths):
            for entry in reversed(self.buckets[rem]):
                yield entry[-1]

    def _unbucket(self, rem: int, entry: Entry) -> None:
        bucket = self.buckets[rem]
        _discard(bucket, entry)
        if not bucket:
            del self.buckets[rem]
            _discard(self.lengths, rem)


def _discard(items: list, item: object) -> None:
    """Remove `item` from the sorted list `items` (it is there)."""
    del items[bisect.bisect_left(items, item)]

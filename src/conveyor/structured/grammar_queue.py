"""GrammarQueue: requests whose grammar is still compiling wait here, outside the scheduler.

A request with structured outputs is added to the scheduler only once its compiled grammar
is ready, so no step ever schedules a request it cannot mask, and no step blocks on a compile
while other requests can run. When nothing else is left to run, `pop_ready(wait_s=...)` waits
a little for the first compile instead of letting the engine loop spin. Deadlines count here
too: a request still waiting at its deadline leaves with it. A request that leaves (aborted,
expired) releases its compile job, which the cache cancels if nobody else waits for it.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait

from conveyor.core.sequence import Sequence
from conveyor.structured.grammar import RequestGrammar
from conveyor.structured.grammar_cache import CompileJob, GrammarCache


class GrammarQueue:
    def __init__(self, cache: GrammarCache) -> None:
        self._cache = cache
        # sequence id -> (the sequence, its grammar's compile job), in arrival order.
        self._pending: dict[str, tuple[Sequence, CompileJob]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def add(self, request: Sequence, job: CompileJob) -> None:
        self._pending[request.request_id] = (request, job)

    def remove(self, request_id: str) -> Sequence | None:
        """Forget a waiting sequence (aborted); None if it is not waiting here."""
        item = self._pending.pop(request_id, None)
        if item is None:
            return None
        self._cache.release(item[1])
        return item[0]

    def pop_ready(
        self, now: float, wait_s: float = 0.0
    ) -> tuple[list[Sequence], list[tuple[Sequence, BaseException]], list[Sequence]]:
        """The sequences whose grammar is ready, each given its RequestGrammar, in arrival
        order; those whose compile failed, with the error; and those whose deadline (at or
        before `now`) passed while they waited.

        Args:
            wait_s: wait up to this long for a first compile to finish when none has.
        """
        if not self._pending:
            return [], [], []
        futures = [job.future for _, job in self._pending.values()]
        if wait_s > 0 and not any(f.done() for f in futures):
            wait(futures, wait_s, return_when=FIRST_COMPLETED)
        ready: list[Sequence] = []
        failed: list[tuple[Sequence, BaseException]] = []
        expired: list[Sequence] = []
        for rid, (req, job) in list(self._pending.items()):
            future = job.future
            if not future.done():
                if req.deadline_at <= now:
                    self.remove(rid)
                    expired.append(req)
                continue
            del self._pending[rid]
            self._cache.release(job)
            exc = RuntimeError("its compile was cancelled") if future.cancelled() else None
            exc = exc or future.exception()
            if exc is not None:
                failed.append((req, exc))
            else:
                req.grammar = RequestGrammar(future.result())
                ready.append(req)
        return ready, failed, expired

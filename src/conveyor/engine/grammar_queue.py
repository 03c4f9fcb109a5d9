"""GrammarQueue: requests whose grammar is still compiling wait here, outside the scheduler.

A request with structured outputs is added to the scheduler only once its compiled grammar
is ready, so no step ever schedules a request it cannot mask, and no step blocks on a compile
while other requests can run. When nothing else is left to run, `pop_ready(wait_s=...)` waits
a little for the first compile instead of letting the engine loop spin.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from conveyor.core.sequence import Sequence
from conveyor.engine.grammar import RequestGrammar


class GrammarQueue:
    def __init__(self) -> None:
        # sequence id -> (the sequence, its grammar's Future), in arrival order.
        self._pending: dict[str, tuple[Sequence, Future[Any]]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def add(self, request: Sequence, future: Future[Any]) -> None:
        self._pending[request.request_id] = (request, future)

    def remove(self, request_id: str) -> Sequence | None:
        """Forget a waiting sequence (aborted); None if it is not waiting here."""
        item = self._pending.pop(request_id, None)
        return None if item is None else item[0]

    def pop_ready(
        self, wait_s: float = 0.0
    ) -> tuple[list[Sequence], list[tuple[Sequence, BaseException]]]:
        """The sequences whose grammar is ready, each given its RequestGrammar, in arrival
        order, and those whose compile failed with the error.

        Args:
            wait_s: wait up to this long for a first compile to finish when none has.
        """
        if not self._pending:
            return [], []
        if wait_s > 0 and not any(f.done() for _, f in self._pending.values()):
            wait([f for _, f in self._pending.values()], wait_s, return_when=FIRST_COMPLETED)
        ready: list[Sequence] = []
        failed: list[tuple[Sequence, BaseException]] = []
        for rid, (req, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            exc = future.exception()
            if exc is not None:
                failed.append((req, exc))
            else:
                req.grammar = RequestGrammar(future.result())
                ready.append(req)
        return ready, failed

"""ReplicaRouter: which data-parallel replica a new request goes to, and which holds a request.

A request's outstanding tokens are its prompt plus the output it may still make:

    outstanding = len(prompt_ids) + n * max_tokens - tokens generated so far

(max_tokens None counts as what the context leaves after the prompt). A replica's load is the
sum over its in-flight requests; a new request goes to the replica with the least load, ties to
the lowest index. Its tokens are released as outputs arrive and all at once when it finishes
(stops, is aborted, fails or is rejected).

A replica whose engine died is taken down (`take_down`): it gets no new request, and the
requests it held are handed back to be failed; `bring_up` returns it once it was restarted.
With none up, `route` raises EngineNotRunningError.

Routing looks at load only, not at prompt prefixes: each replica has its own prefix cache, so
two requests sharing a system prompt may land on different replicas and both compute it.

Thread safety: `route` runs on the event loop, `progress` and `release` in the replicas' reader
threads; one lock guards the counters.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from conveyor.entrypoints.request_stream import EngineNotRunningError


@dataclass(slots=True)
class _InFlight:
    replica: int
    outstanding: int


class ReplicaRouter:
    """Args:
    num_replicas: how many replicas requests are spread over (>= 1).
    max_model_len: the model's context, to count a request without max_tokens.
    """

    def __init__(self, num_replicas: int, max_model_len: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
        self.max_model_len = max_model_len
        self._loads = [0] * num_replicas
        self._counts = [0] * num_replicas  # in-flight requests per replica
        self._requests: dict[str, _InFlight] = {}
        self._up = [True] * num_replicas  # False while a replica is down (restarting)
        self._lock = threading.Lock()

    @property
    def loads(self) -> list[int]:
        """Outstanding tokens per replica (a copy)."""
        with self._lock:
            return list(self._loads)

    @property
    def num_serving(self) -> int:
        """How many replicas are up (get new requests)."""
        with self._lock:
            return sum(self._up)

    def take_down(self, replica: int) -> list[str]:
        """Stop routing to `replica` (its engine died) and forget what it held.

        Returns:
            The ids of the requests it held, which will never finish there.
        """
        with self._lock:
            self._up[replica] = False
            ids = [rid for rid, entry in self._requests.items() if entry.replica == replica]
            for rid in ids:
                del self._requests[rid]
            self._loads[replica] = self._counts[replica] = 0
            return ids

    def bring_up(self, replica: int) -> None:
        """Route to `replica` again (its engine was restarted)."""
        with self._lock:
            self._up[replica] = True

    def num_in_flight(self, replica: int) -> int:
        """How many routed requests replica `replica` holds that have not finished."""
        with self._lock:
            return self._counts[replica]

    def replica_of(self, request_id: str) -> int | None:
        """The replica that holds `request_id`, None once it has finished (or was never
        routed)."""
        with self._lock:
            entry = self._requests.get(request_id)
            return None if entry is None else entry.replica

    def route(self, request_id: str, num_prompt_tokens: int, max_tokens: int | None, n: int) -> int:
        """Pick the least-loaded replica for a new request and count its tokens there.

        Returns:
            The replica's index.
        Raises:
            ValueError: `request_id` is already in flight.
            EngineNotRunningError: every replica is down.
        """
        if max_tokens is None:
            max_tokens = max(self.max_model_len - num_prompt_tokens, 0)
        cost = num_prompt_tokens + n * max_tokens
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} is already in flight.")
            up = [i for i, is_up in enumerate(self._up) if is_up]
            if not up:
                raise EngineNotRunningError(
                    "No data-parallel replica serves right now (they are restarting); retry "
                    "shortly."
                )
            replica = min(up, key=self._loads.__getitem__)
            self._loads[replica] += cost
            self._counts[replica] += 1
            self._requests[request_id] = _InFlight(replica, cost)
            return replica

    def progress(self, request_id: str, num_new_tokens: int, finished: bool) -> None:
        """Account a delta output: `num_new_tokens` fewer may still come; a finished request
        releases everything it still held. Unknown ids are ignored."""
        with self._lock:
            entry = self._requests.get(request_id)
            if entry is None:
                return
            done = entry.outstanding if finished else min(num_new_tokens, entry.outstanding)
            entry.outstanding -= done
            self._loads[entry.replica] -= done
            if finished:
                del self._requests[request_id]
                self._counts[entry.replica] -= 1

    def release(self, request_id: str) -> None:
        """The request ended without a final output (rejected): release its tokens."""
        self.progress(request_id, 0, finished=True)

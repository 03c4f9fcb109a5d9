"""EngineClient: what AsyncLLM needs of whatever runs the engine, and what it gets back.

Two transports implement it: EngineThread (a thread of this process steps the engine) and
EngineProcess (a child process does, behind two pipes). Both call the same three callbacks,
from a thread of their own: `emit(outputs, stats)` after every step and applied batch of
aborts, `reject(request_id, error)` for an add the engine refused, `on_dead(error)` once if it
stops for good. AsyncLLM hands each to its event loop. A third, DataParallelClient
(data_parallel.py), drives N EngineProcess replicas and adds the replica's index:
`emit(outputs, stats, replica)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from conveyor.sampling_params import SamplingParams


@dataclass(slots=True)
class StepStats:
    """The scheduler's state after a step, for the metrics."""

    num_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    step_time_s: float = 0.0  # how long engine.step() ran; 0 when no step ran
    # Cumulative prefix-cache lookups of admitted requests, in tokens: asked for, found.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineClient(Protocol):
    """The engine's transport, as AsyncLLM drives it. Every method returns at once except
    `stop`; adds and aborts are applied between steps, in the order they were made."""

    @property
    def started(self) -> bool:
        """`start()` was called."""
        ...

    @property
    def alive(self) -> bool:
        """The engine still steps (False once it stopped or died)."""
        ...

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences not yet running: queued in the transport plus the scheduler's waiting."""
        ...

    def start(self) -> None:
        """Begin stepping."""
        ...

    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        """Queue a request; it joins before the next step."""
        ...

    def abort(self, request_id: str) -> None:
        """Queue an abort, applied after any add queued before it."""
        ...

    def abort_all_at(self, when: float, reason: str) -> None:
        """From `when` (time.monotonic) on, abort every request with `reason`."""
        ...

    def stop(self, final_reason: str | None = None, timeout_s: float | None = None) -> None:
        """Blocking: end the current step, abort what is left with `final_reason`, emit it,
        and stop; give up waiting after about `timeout_s` seconds (None: a generous default)."""
        ...

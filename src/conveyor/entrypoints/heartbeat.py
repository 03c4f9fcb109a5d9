"""Heartbeat: is the engine still stepping while it has work? (Progress, not liveness.)

Liveness is the engine process's own beat (engine_child.py's EngineBeat, checked by
EngineProcess against engine_heartbeat_timeout): a process that sends nothing is stopped or
dead-locked, and is killed. This module asks the other question: a live engine may still make
no progress.

The engine reports after every step it makes (and after every applied batch of aborts); an
idle engine reports nothing, and that is fine. So the engine counts as hung only when requests
are in flight and nothing has come from it for `timeout_s` seconds, counted from its latest
report or from when work arrived at an idle engine, whichever is later:

    idle ── work arrives (beat) ── step ── step ── ... ── silence > timeout_s ──► hung
                                                                  │ a report ──► healthy

While hung, /health answers 503 and no request is admitted; the requests that were in flight
have been ended with an error (AsyncLLM's watchdog). A later report (the engine was only
slow, or a stopped process was continued) makes it healthy again.
"""

from __future__ import annotations

import time


class Heartbeat:
    """Args:
    timeout_s: seconds without a report, with work in flight, before the engine is hung;
        None or 0 turns the check off.
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s or None
        self._last = time.monotonic()
        self.hung: str | None = None  # why the engine counts as hung, or None

    @property
    def poll_interval_s(self) -> float:
        """How often a watchdog should call `check`."""
        return min(1.0, (self.timeout_s or 4.0) / 4)

    def beat(self, now: float) -> None:
        """The engine reported (or work arrived at an idle engine): it is alive as of now."""
        self._last = now
        self.hung = None

    def check(self, now: float, num_in_flight: int) -> bool:
        """Whether the engine has just become hung (True once per hang).

        Args:
            now: time.monotonic().
            num_in_flight: requests the engine holds that have not ended yet.
        """
        if self.timeout_s is None or self.hung is not None or not num_in_flight:
            return False
        silent = now - self._last
        if silent <= self.timeout_s:
            return False
        self.hung = (
            f"The engine has made no step for {silent:.1f} s with {num_in_flight} request(s) in "
            f"flight (engine_stall_timeout is {self.timeout_s:g} s): it is hung."
        )
        return True

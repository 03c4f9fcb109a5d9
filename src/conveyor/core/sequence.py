"""One request's state as the scheduler sees it: counters, not phases.

A request holds `num_tokens` known tokens (prompt + sampled outputs), of which the first
`num_computed_tokens` already have their K/V in the cache:

    all_token_ids:  [ p0 p1 p2 p3 p4 | o0 o1 ]        num_tokens = 7
    KV cache:       [ p0 p1 p2 p3 p4 | o0 ]           num_computed_tokens = 6
                                          ^ next step computes o1 and samples o2

Prefill, chunked prefill, decode and recompute after preemption are all the same thing:
the scheduler hands out `num_tokens - num_computed_tokens` (or fewer) tokens per step, and a
token is sampled when a step brings `num_computed_tokens` up to `num_tokens`.
"""

from __future__ import annotations

import enum
import math
import time
from typing import Any

from conveyor.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# Module constants for the per-step paths: reading a member off the enum class goes through
# EnumType.__getattr__'s slow attribute hook, a global does not.
_FIRST_FINISHED = SequenceStatus.FINISHED_STOPPED

_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """A single sequence being generated (a request with n > 1 becomes n of these)."""

    __slots__ = (
        "abort_reason",
        "admitted_at",
        "arrival_time",
        "block_hashes",
        "deadline_at",
        "eos_token_id",
        "fault",
        "grammar",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "output_token_ids",
        "prompt_token_ids",
        "request_id",
        "sample_index",
        "sampling_params",
        "status",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        sample_index: int = 0,
    ) -> None:
        """Args:
        max_tokens: the output cap after clamping to the model's context
            (`sampling_params.max_tokens` may be None or larger).
        eos_token_id: ends the request when sampled, unless `ignore_eos`.
        sample_index: which of the request's n samples this is (a seeded sample draws from
            `sample_seed(seed, sample_index)`).
        """
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.sample_index = sample_index
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Absolute time (arrival clock) after which the request is aborted; inf if none.
        deadline = sampling_params.deadline
        self.deadline_at = math.inf if deadline is None else self.arrival_time + deadline
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Prompt tokens its first admission found in the prefix cache (-1 until admitted).
        self.num_cached_tokens = -1
        # Chained hashes of its full blocks so far (the block manager fills it lazily).
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        self.status = SequenceStatus.WAITING
        # The token id or stop string that ended the request, as vLLM reports it.
        self.stop_reason: int | str | None = None
        # Why the engine aborted it (e.g. its deadline passed); None for a caller's abort.
        self.abort_reason: str | None = None
        # The exception its own processing raised (it then ends FINISHED_ABORTED).
        self.fault: Exception | None = None
        # Scheduler clock time at which it last joined `running` (None while never admitted);
        # preemptive policies leave a request alone for a cooldown after this.
        self.admitted_at: float | None = None
        # Its output constraint's matcher (conveyor.structured.grammar.RequestGrammar; opaque to
        # core); None when unconstrained. It follows `output_token_ids`, which a recompute
        # after preemption keeps, so preemption never invalidates it.
        self.grammar: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the two lists."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def tenant(self) -> str:
        return self.sampling_params.tenant

    @property
    def expected_output_tokens(self) -> int:
        """Output length the scheduler plans with: `length_hint` if given, else `max_tokens`."""
        hint = self.sampling_params.length_hint
        return self.max_tokens if hint is None else min(hint, self.max_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self) -> SequenceStatus | None:
        """Token-level stop rules after a token was appended: eos, stop_token_ids, max_tokens.

        Stop *strings* need text and are checked by the detokenizer, outside core.
        Returns the finished status to set, or None to keep going.
        """
        n = len(self.output_token_ids)
        if n == 0:
            return None
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if n >= params.min_tokens:
            if last == self.eos_token_id and not params.ignore_eos:
                self.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return SequenceStatus.FINISHED_STOPPED
        if n >= self.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )

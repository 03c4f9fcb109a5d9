"""SchedulerOutput: what one scheduler step hands to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.sequence import Sequence


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs; plain data for the model runner.

    A request is sampled in this step iff
    `num_computed_tokens + num_scheduled_tokens[id] == num_tokens` (read before the update).
    """

    # Batch order: running requests first (admission order), then the newly admitted.
    scheduled: list[Sequence]
    # New tokens per request id: prefill chunk, whole prompt, recompute or 1 decode token.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Live block tables of the scheduled requests (read-only; see BlockManager).
    block_tables: dict[str, list[int]]
    # Preempted (recompute) in this step; their cached K/V is gone.
    preempted_request_ids: list[str]
    # Finished for any reason since the previous schedule(): drop per-request state.
    finished_request_ids: list[str]
    # Joined `running` in this step (new, or back after preemption); the tail of `scheduled`.
    admitted: list[Sequence] = field(default_factory=list)

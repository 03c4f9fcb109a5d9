"""Trace simulator: the real Scheduler and BlockManager, a cost model in place of the model.

`simulate()` replays a trace (trace.py) under any scheduling policy. Each step the real
scheduler decides what runs; instead of executing a model the simulator advances a clock by
`StepCost(tokens, seqs)` and "samples" one token for every request that reached the end of its
known tokens: eos when the request has reached its trace length, another token otherwise. No
weights, no torch: thousands of requests take about a second.

    clock ──► add arrivals ≤ clock ──► schedule() ──► clock += cost(step) ──► update
                ▲  (idle: jump to the next arrival)                              │
                └────────────────────────────────────────────────────────────────┘

Step k (1-based) starts at the clock value before its cost is added and ends after it: a
request admitted in step k has waited `start(k) - arrival`; its first token exists at
`end(k)` (TTFT), and it is done at the end of the step that sampled its last token (e2e).
"""

from __future__ import annotations

import dataclasses
import math
from collections import abc
from dataclasses import dataclass
from typing import Any

from conveyor.config import EngineConfig
from conveyor.core.scheduler import Scheduler
from conveyor.core.sequence import Sequence
from conveyor.sampling_params import SamplingParams
from conveyor.simulator.summary import RequestTimeline, SimulationResult
from conveyor.simulator.trace import TraceRequest
from conveyor.validation import check_number

_EOS, _TOKEN = 0, 1


@dataclass(slots=True)
class StepCost:
    """Seconds one step takes: `base_s + per_token_s * tokens + per_seq_s * seqs`.

    The defaults approximate the demo model on 2 CPU cores; benchmarks/scheduling.py fits
    them to measured steps.
    """

    base_s: float = 0.005
    per_token_s: float = 0.00015
    per_seq_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_s", "per_token_s", "per_seq_s"):
            check_number(name, getattr(self, name), ">= 0 and finite", lambda v: 0 <= v < math.inf)
        if self.base_s + self.per_token_s + self.per_seq_s == 0:
            raise ValueError("a step must cost something: give base_s, per_token_s or per_seq_s.")

    def __call__(self, num_tokens: int, num_seqs: int) -> float:
        return self.base_s + self.per_token_s * num_tokens + self.per_seq_s * num_seqs


def simulate(
    trace: abc.Sequence[TraceRequest],
    config: EngineConfig | None = None,
    cost: StepCost | None = None,
    **config_kwargs: Any,
) -> SimulationResult:
    """Replay `trace` through the real scheduler with a step-cost model.

    Args:
        trace: the requests (any order; replayed by arrival time).
        config: scheduler settings (scheduler, max_num_seqs, max_num_batched_tokens,
            block_size, num_kv_blocks, policy knobs); or give them as keyword arguments.
            num_kv_blocks None means enough blocks for max_num_seqs of the longest request
            (no KV pressure); max_model_len None means the longest request.
        cost: the step-cost model; StepCost() by default.
    Returns:
        The SimulationResult; `.summary()` has the headline numbers.
    Raises:
        ValueError: bad settings, or a request that could never fit the KV cache.
    """
    if config is None:
        config = EngineConfig(**config_kwargs)
    elif config_kwargs:
        config = dataclasses.replace(config, **config_kwargs)
    else:
        config = dataclasses.replace(config)
    # A trace has lengths, not token ids (every simulated prompt is the same token repeated),
    # so a prefix cache would find hits that real prompts would not: it stays off here.
    config.enable_prefix_caching = False
    cost = StepCost() if cost is None else cost
    if not trace:
        raise ValueError("the trace has no requests.")
    trace = sorted(trace, key=lambda r: r.arrival_time)
    longest = max(r.prompt_len + r.max_tokens for r in trace)
    if config.max_model_len is None:
        config.max_model_len = longest
    if config.num_kv_blocks is None:
        config.num_kv_blocks = config.max_num_seqs * -(-longest // config.block_size)

    now = trace[0].arrival_time
    sched = Scheduler(config, clock=lambda: now)
    result = SimulationResult(config.scheduler, config.max_num_seqs, [])
    timelines: dict[str, RequestTimeline] = {}
    requests: dict[str, Sequence] = {}
    i, n = 0, len(trace)
    while i < n or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests() and now < trace[i].arrival_time:
            now = trace[i].arrival_time  # idle until the next arrival
        while i < n and trace[i].arrival_time <= now:
            req, tl = _make_request(trace[i], i)
            if req.request_id in requests:
                raise ValueError(f"request_id {req.request_id!r} appears twice in the trace.")
            sched.add_request(req)
            requests[req.request_id], timelines[req.request_id] = req, tl
            i += 1
        out = sched.schedule()
        for rid in out.finished_request_ids:  # aborted at its deadline inside schedule()
            tl = timelines[rid]
            if tl.finish_time is None:
                tl.finish_time = now
        if out.total_num_scheduled_tokens == 0:
            if i < n:
                now = max(now, trace[i].arrival_time)
                continue
            if sched.has_unfinished_requests():
                raise RuntimeError("the scheduler made no progress with nothing left to arrive.")
            break
        step = len(result.step_batch_sizes) + 1
        start = now
        num_sched = out.num_scheduled_tokens
        sampled: dict[str, int] = {}
        for req in out.scheduled:
            rid = req.request_id
            tl = timelines[rid]
            if tl.first_scheduled_time is None:
                tl.first_scheduled_time, tl.first_scheduled_step = start, step
            if req.num_computed_tokens + num_sched[rid] == req.num_tokens:
                # eos ends it at its trace length (a cap equal to that length ends it first).
                last = len(req.output_token_ids) + 1 >= tl.output_len < req.max_tokens
                sampled[rid] = _EOS if last else _TOKEN
        now = start + cost(out.total_num_scheduled_tokens, len(out.scheduled))
        for req in sched.update_from_output(out, sampled):
            tl = timelines[req.request_id]
            if tl.first_token_time is None:
                tl.first_token_time, tl.first_token_step = now, step
            if req.is_finished:
                tl.finish_time, tl.finish_step = now, step
        result.step_end_times.append(now)
        result.step_batch_sizes.append(len(out.scheduled))
        result.step_num_tokens.append(out.total_num_scheduled_tokens)
        result.step_num_waiting.append(sched.num_waiting)
        result.step_kv_usage.append(sched.kv_usage)
    result.num_preemptions = sched.num_preemptions
    for rid, tl in timelines.items():
        req = requests[rid]
        tl.num_output_tokens = len(req.output_token_ids)
        tl.num_preemptions = req.num_preemptions
        tl.finish_reason = req.status.finish_reason
        tl.abort_reason = req.abort_reason
    result.requests = list(timelines.values())
    return result


def _make_request(row: TraceRequest, index: int) -> tuple[Sequence, RequestTimeline]:
    rid = str(index) if row.request_id is None else row.request_id
    params = SamplingParams(
        max_tokens=row.max_tokens,
        priority=row.priority,
        deadline=row.deadline,
        length_hint=row.length_hint,
    )
    # Token ids do not matter to scheduling; eos (0) ends the request at its trace length.
    req = Sequence(
        rid,
        [_TOKEN] * row.prompt_len,
        params,
        max_tokens=row.max_tokens,
        eos_token_id=_EOS,
        arrival_time=row.arrival_time,
    )
    tl = RequestTimeline(rid, row.arrival_time, row.prompt_len, row.output_len, row.priority)
    return req, tl

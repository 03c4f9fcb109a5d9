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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conveyor.config import EngineConfig
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler
from conveyor.sampling_params import SamplingParams
from conveyor.trace import TraceRequest

_EOS, _TOKEN = 0, 1


@dataclass(slots=True)
class StepCost:
    """Seconds one step takes: `base_s + per_token_s * tokens + per_seq_s * seqs`.

    The defaults approximate the demo model on 2 CPU cores (design.md: ~5 ms at batch 1,
    ~7 ms at 16 decode tokens); benchmarks/scheduling.py fits them to measured steps.
    """

    base_s: float = 0.005
    per_token_s: float = 0.00015
    per_seq_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_s", "per_token_s", "per_seq_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}.")
        if self.base_s + self.per_token_s + self.per_seq_s == 0:
            raise ValueError("a step must cost something: give base_s, per_token_s or per_seq_s.")

    def __call__(self, num_tokens: int, num_seqs: int) -> float:
        return self.base_s + self.per_token_s * num_tokens + self.per_seq_s * num_seqs


@dataclass(slots=True)
class RequestTimeline:
    """One request's life in the simulation (times in seconds, steps 1-based; None: never)."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    priority: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    abort_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        t = self.first_token_time
        return None if t is None else t - self.arrival_time

    @property
    def e2e(self) -> float | None:
        t = self.finish_time
        return None if t is None else t - self.arrival_time


@dataclass(slots=True)
class SimulationResult:
    """Per-request timelines, per-step series and the config a simulation ran with."""

    scheduler: str
    max_num_seqs: int
    requests: list[RequestTimeline]
    # One entry per step that ran: its end time, batch size, tokens, queue length, KV usage.
    step_end_times: list[float] = field(default_factory=list)
    step_batch_sizes: list[int] = field(default_factory=list)
    step_num_tokens: list[int] = field(default_factory=list)
    step_num_waiting: list[int] = field(default_factory=list)
    step_kv_usage: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    def summary(self) -> dict[str, Any]:
        """The headline numbers.

        Returns:
            iterations (steps that ran), slot_iterations (request-steps) out of
            slot_capacity (iterations x max_num_seqs) and their ratio `utilization`,
            mean_batch_size, mean/max kv_usage, makespan_s (first arrival to last finish),
            throughput in finished requests and output tokens per second, TTFT and e2e
            latency p50/p90/p99 over completed requests, preemptions, and counts.
        """
        reqs = self.requests
        done = [r for r in reqs if r.finish_reason in ("stop", "length")]
        iters = len(self.step_batch_sizes)
        used = sum(self.step_batch_sizes)
        start = min((r.arrival_time for r in reqs), default=0.0)
        end = max((r.finish_time for r in reqs if r.finish_time is not None), default=start)
        span = end - start
        out_tokens = sum(r.num_output_tokens for r in done)
        ttft = sorted(r.ttft for r in done if r.ttft is not None)
        e2e = sorted(r.e2e for r in done if r.e2e is not None)
        result: dict[str, Any] = {
            "scheduler": self.scheduler,
            "num_requests": len(reqs),
            "num_completed": len(done),
            "num_aborted": sum(r.finish_reason == "abort" for r in reqs),
            "iterations": iters,
            "slot_iterations": used,
            "slot_capacity": iters * self.max_num_seqs,
            "utilization": used / (iters * self.max_num_seqs) if iters else 0.0,
            "mean_batch_size": used / iters if iters else 0.0,
            "mean_kv_usage": sum(self.step_kv_usage) / iters if iters else 0.0,
            "max_kv_usage": max(self.step_kv_usage, default=0.0),
            "makespan_s": span,
            "throughput_rps": len(done) / span if span > 0 else 0.0,
            "output_tokens_per_s": out_tokens / span if span > 0 else 0.0,
            "preemptions": self.num_preemptions,
        }
        for name, values in (("ttft", ttft), ("e2e", e2e)):
            for q in (50, 90, 99):
                result[f"{name}_p{q}_s"] = percentile(values, q)
            result[f"{name}_mean_s"] = sum(values) / len(values) if values else math.nan
        return result

    def to_dict(self, timelines: bool = True, steps: bool = False) -> dict[str, Any]:
        """JSON-ready dict: the summary, and optionally timelines and per-step series."""
        out: dict[str, Any] = {"summary": self.summary()}
        if timelines:
            out["requests"] = [dataclasses.asdict(r) for r in self.requests]
        if steps:
            out["steps"] = {
                "end_time": self.step_end_times,
                "batch_size": self.step_batch_sizes,
                "num_tokens": self.step_num_tokens,
                "num_waiting": self.step_num_waiting,
                "kv_usage": self.step_kv_usage,
            }
        return out


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, linearly interpolated (numpy's default).

    Returns:
        NaN for no values.
    """
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def simulate(
    trace: Sequence[TraceRequest],
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
    requests: dict[str, Request] = {}
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


def _make_request(row: TraceRequest, index: int) -> tuple[Request, RequestTimeline]:
    rid = str(index) if row.request_id is None else row.request_id
    params = SamplingParams(
        max_tokens=row.max_tokens,
        priority=row.priority,
        deadline=row.deadline,
        length_hint=row.length_hint,
    )
    # Token ids do not matter to scheduling; eos (0) ends the request at its trace length.
    req = Request(
        rid,
        [_TOKEN] * row.prompt_len,
        params,
        max_tokens=row.max_tokens,
        eos_token_id=_EOS,
        arrival_time=row.arrival_time,
    )
    tl = RequestTimeline(rid, row.arrival_time, row.prompt_len, row.output_len, row.priority)
    return req, tl


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of `SimulationResult.summary()` dicts, one row per policy.

    When a `static` row is present, each row also shows its throughput and p99 e2e latency as
    a ratio to static's.
    """
    static = next((s for s in summaries if s["scheduler"] == "static"), None)
    head = (
        f"{'scheduler':<15}{'iters':>7}{'batch':>7}{'util':>6}{'req/s':>9}{'tok/s':>9}"
        f"{'ttft50':>8}{'ttft99':>8}{'e2e50':>8}{'e2e90':>8}{'e2e99':>8}{'preempt':>8}"
        f"{'abort':>6}"
    )
    if static is not None:
        head += f"{'thr/static':>11}{'p99/static':>11}"
    lines = [head]
    for s in summaries:
        line = (
            f"{s['scheduler']:<15}{s['iterations']:>7}{s['mean_batch_size']:>7.2f}"
            f"{s['utilization']:>6.0%}{s['throughput_rps']:>9.2f}{s['output_tokens_per_s']:>9.1f}"
            f"{s['ttft_p50_s']:>8.3f}{s['ttft_p99_s']:>8.3f}{s['e2e_p50_s']:>8.3f}"
            f"{s['e2e_p90_s']:>8.3f}{s['e2e_p99_s']:>8.3f}{s['preemptions']:>8}"
            f"{s['num_aborted']:>6}"
        )
        if static is not None:
            line += (
                f"{_ratio(s['throughput_rps'], static['throughput_rps']):>11.2f}"
                f"{_ratio(s['e2e_p99_s'], static['e2e_p99_s']):>11.2f}"
            )
        lines.append(line)
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan

"""What a simulation returns: per-request timelines, per-step series, and their summary.

`loop.simulate()` fills a SimulationResult; `summary()` turns it into the headline numbers
(iterations, utilization, throughput, TTFT / e2e percentiles) and `format_table` prints them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


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

"""Prometheus metrics and the periodic stats log line of one AsyncLLM.

Names follow vLLM's with the prefix `conveyor:` (so dashboards built for vLLM carry over), and
every series has a `model_name` label. Each EngineMetrics owns its CollectorRegistry, so several
engines (or apps in one test process) never clash on the global registry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conveyor.engine.outputs import MetricName

if TYPE_CHECKING:
    from conveyor.engine.outputs import RequestOutput

logger = logging.getLogger("conveyor.stats")

# vLLM's buckets, with finer low ends: on CPU a decode step of a small model takes a few ms.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineMetrics:
    """The engine's Prometheus series plus a throughput log line every `log_interval_s`.

    The line's throughputs are tokens per second of engine busy time (the summed durations of
    the interval's steps), not per second of the interval: a burst followed by an idle gap
    reports the burst's rate, and the line says how much of the interval was busy. An interval
    in which no step ran and no request is queued logs nothing.
    """

    def __init__(
        self,
        model_name: str,
        log_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        replica: int | None = None,
    ) -> None:
        """Args:
        model_name: the `model_name` label value (the served model name).
        replica: a data-parallel replica's index: every series also gets a `replica` label
            (vLLM's `engine` label), and the log line names it. None: no such label.
        log_interval_s: seconds between stats log lines while busy; <= 0 disables them.
        clock: where the first interval's start comes from; `maybe_log`'s `now` must come
            from the same clock (tests pass a fake one).
        """
        self.registry = CollectorRegistry()
        reg, name = self.registry, ["model_name"]
        self._label_values = [model_name]
        if replica is not None:
            name.append("replica")
            self._label_values.append(str(replica))
        self._log_prefix = "" if replica is None else f"Replica {replica}: "

        def labeled(metric: Gauge | Counter | Histogram) -> Gauge | Counter | Histogram:
            return metric.labels(*self._label_values)

        self.running = labeled(
            Gauge(MetricName.NUM_REQUESTS_RUNNING, "Requests in the batch.", name, registry=reg)
        )
        self.waiting = labeled(
            Gauge(MetricName.NUM_REQUESTS_WAITING, "Requests waiting to run.", name, registry=reg)
        )
        self.kv_usage = labeled(
            Gauge(MetricName.KV_CACHE_USAGE_PERC, "KV cache usage, 1 = full.", name, registry=reg)
        )
        self.prompt_tokens = labeled(
            Counter(MetricName.PROMPT_TOKENS, "Prefilled prompt tokens.", name, registry=reg)
        )
        self.generation_tokens = labeled(
            Counter(MetricName.GENERATION_TOKENS, "Generated tokens.", name, registry=reg)
        )
        self.preemptions = labeled(
            Counter(MetricName.NUM_PREEMPTIONS, "Preemptions (recompute).", name, registry=reg)
        )
        # vLLM's names: tokens the prefix cache was asked for / found, at admission.
        self.prefix_cache_queries = labeled(
            Counter(
                MetricName.PREFIX_CACHE_QUERIES,
                "Prompt tokens looked up in the prefix cache.",
                name,
                registry=reg,
            )
        )
        self.prefix_cache_hits = labeled(
            Counter(
                MetricName.PREFIX_CACHE_HITS,
                "Prompt tokens found in the prefix cache.",
                name,
                registry=reg,
            )
        )
        self._success = Counter(
            "conveyor:request_success",
            "Finished sequences by finish reason.",
            [*name, "finished_reason"],
            registry=reg,
        )
        self.ttft = labeled(
            Histogram(
                "conveyor:time_to_first_token_seconds",
                "Arrival to first token.",
                name,
                registry=reg,
                buckets=_TTFT_BUCKETS,
            )
        )
        self.itl = labeled(
            Histogram(
                "conveyor:inter_token_latency_seconds",
                "Time between consecutive tokens of a request.",
                name,
                registry=reg,
                buckets=_ITL_BUCKETS,
            )
        )
        self.e2e = labeled(
            Histogram(
                "conveyor:e2e_request_latency_seconds",
                "Arrival to finish.",
                name,
                registry=reg,
                buckets=_REQUEST_BUCKETS,
            )
        )
        self.queue_time = labeled(
            Histogram(
                "conveyor:request_queue_time_seconds",
                "Arrival to first scheduled.",
                name,
                registry=reg,
                buckets=_REQUEST_BUCKETS,
            )
        )
        self.step_tokens = labeled(
            Histogram(
                "conveyor:iteration_tokens_total",
                "Tokens computed per engine step (prefill + decode).",
                name,
                registry=reg,
                buckets=_STEP_TOKEN_BUCKETS,
            )
        )
        self._log_interval = log_interval_s
        self._last_log = clock()
        self._prompt_total = self._generation_total = 0
        self._logged_prompt = self._logged_generation = 0
        self._busy_s = 0.0  # engine step time since the last log line
        self._num_preemptions = 0
        self._prefix_queries = self._prefix_hits = 0  # cumulative, as the engine reports them
        self._logged_queries = self._logged_hits = 0
        self._state = (0, 0, 0.0)  # running, waiting, kv usage

    def record_step(
        self,
        num_tokens: int,
        num_running: int,
        num_waiting: int,
        kv_usage: float,
        num_preemptions: int,
        step_time_s: float = 0.0,
        prefix_cache_queries: int = 0,
        prefix_cache_hits: int = 0,
    ) -> None:
        """Record one engine step (num_tokens == 0: only refresh the gauges).

        Args:
            num_tokens: tokens the step computed.
            num_running, num_waiting, kv_usage: the scheduler's state after the step.
            num_preemptions: the scheduler's cumulative preemption count.
            step_time_s: how long the step ran (0: no step, e.g. an emit of aborts only).
            prefix_cache_queries, prefix_cache_hits: the engine's cumulative prefix-cache
                lookups, in tokens.
        """
        self._busy_s += step_time_s
        if num_tokens:
            self.step_tokens.observe(num_tokens)
        if num_preemptions > self._num_preemptions:
            self.preemptions.inc(num_preemptions - self._num_preemptions)
            self._num_preemptions = num_preemptions
        if prefix_cache_queries > self._prefix_queries:
            self.prefix_cache_queries.inc(prefix_cache_queries - self._prefix_queries)
            self.prefix_cache_hits.inc(prefix_cache_hits - self._prefix_hits)
            self._prefix_queries, self._prefix_hits = prefix_cache_queries, prefix_cache_hits
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        self._state = (num_running, num_waiting, kv_usage)

    def record_output(
        self,
        out: RequestOutput,
        num_prompt_tokens: int,
        last_token_time: float | None,
        now: float,
    ) -> float | None:
        """Account one delta output of a request.

        Args:
            out: the delta (its token ids are the new ones; `out.metrics` has the engine's
                arrival, first-scheduled and first-token times).
            num_prompt_tokens: the request's prompt length (counted with its first token).
            last_token_time: when its previous tokens came; None before the first.
            now: the current `time.monotonic()`.
        Returns:
            The request's new last-token time.
        """
        num_new = sum(len(c.token_ids) for c in out.outputs)
        m = out.metrics
        arrival = m.arrival_time if m is not None else now
        if num_new:
            if last_token_time is None:  # the prompt is prefilled: time to first token
                first = m.first_token_time if m is not None and m.first_token_time else now
                self.ttft.observe(first - arrival)
                if m is not None and m.first_scheduled_time is not None:
                    self.queue_time.observe(m.first_scheduled_time - arrival)
                self.prompt_tokens.inc(num_prompt_tokens)
                self._prompt_total += num_prompt_tokens
            else:
                self.itl.observe(now - last_token_time)
            self.generation_tokens.inc(num_new)
            self._generation_total += num_new
            last_token_time = now
        if out.embedding is not None:  # an embedding request: its prompt, no tokens
            self.prompt_tokens.inc(num_prompt_tokens)
            self._prompt_total += num_prompt_tokens
        if out.finished:
            self.e2e.observe(now - arrival)
            for c in out.outputs:
                self._success.labels(*self._label_values, c.finish_reason or "abort").inc()
        return last_token_time

    def maybe_log(self, now: float) -> None:
        """Log throughput over busy time and queue state if `log_interval_s` passed and there
        was work (`now`: the constructor's clock)."""
        elapsed = now - self._last_log
        if self._log_interval <= 0 or elapsed < self._log_interval:
            return
        prompt = self._prompt_total - self._logged_prompt
        generation = self._generation_total - self._logged_generation
        busy = self._busy_s
        running, waiting, kv = self._state
        self._last_log, self._busy_s = now, 0.0
        self._logged_prompt, self._logged_generation = self._prompt_total, self._generation_total
        queries = self._prefix_queries - self._logged_queries
        hits = self._prefix_hits - self._logged_hits
        self._logged_queries, self._logged_hits = self._prefix_queries, self._prefix_hits
        if not (prompt or generation or busy or running or waiting):
            return  # idle: nothing to report
        # Requests queued but no step ran: a stalled engine, shown as 0 tokens/s.
        rate = 1 / busy if busy > 0 else 0.0
        logger.info(
            "%sAvg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%, Engine busy: %.2f s of %.1f s",
            self._log_prefix,
            prompt * rate,
            generation * rate,
            running,
            waiting,
            100 * kv,
            100 * hits / queries if queries else 0.0,
            busy,
            elapsed,
        )

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)

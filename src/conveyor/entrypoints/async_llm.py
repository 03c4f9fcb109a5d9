"""AsyncLLM: LLMEngine behind an asyncio API; each request gets its own stream of deltas.

    generate() ──► EngineThread.add ──┐   engine thread: apply adds/aborts, step, step, ...
    abort()    ──► EngineThread.abort ┘        │ emit(outputs, stats) per step
        ▲                                      ▼ call_soon_threadsafe
        └──── RequestStream.queue ◄──── _on_step (event loop): deltas to each request's
                                        queue, metrics

The engine thread steps back to back and never waits for the event loop, which meanwhile
serves HTTP and streams the previous step's deltas. Only that thread changes the engine;
callers here make read-only checks (tokenizer, `check_prompt`, queue lengths), so requests
join and leave between steps. A fault of one request fails only it; an exception of a whole
step fails the requests that step scheduled; only an error that recovery cannot handle makes
the engine dead (`check_health` raises, `dead` is True). An engine that makes no step for
`engine_stall_timeout_s` while requests are in flight is hung (heartbeat.py): a watchdog ends
those requests with EngineNotRunningError, and `check_health` raises until it steps again.
`check_admission` refuses new work (HTTP 503) while more than `max_waiting_requests` sequences
wait. With `engine_process=True` the same thread runs in a child process (engine_process.py)
and its reports arrive through a pipe; with `data_parallel_size` N > 1 too, N such processes
(data_parallel.py) each get their own heartbeat and metrics (labelled `replica`). A replica
that dies fails only the requests it held and is restarted, up to `max_replica_restarts`
times each; the engine is dead only past that (or when a single engine dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from conveyor.config import EngineConfig
from conveyor.core.limits import PromptError
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.entrypoints.engine_client import EngineClient, StepStats
from conveyor.entrypoints.engine_start import start_engine
from conveyor.entrypoints.heartbeat import Heartbeat
from conveyor.entrypoints.metrics import EngineMetrics
from conveyor.entrypoints.model_names import served_model_names
from conveyor.entrypoints.replica_metrics import DataParallelMetrics
from conveyor.entrypoints.request_stream import (
    EngineNotRunningError,
    EngineOverloadedError,
    RequestFailedError,
    RequestRejectedError,
    RequestStream,
)
from conveyor.sampling_params import SamplingParams

__all__ = [
    "AsyncLLM",
    "EngineNotRunningError",
    "EngineOverloadedError",
    "PromptError",
    "RequestFailedError",
    "RequestRejectedError",
]

logger = logging.getLogger(__name__)

_SHUTDOWN_REASON = "server shutting down: the request did not finish within the grace period"


class AsyncLLM:
    """Serve many concurrent requests from one engine, streaming deltas as they are made.

    Args:
        model: a Hugging Face checkpoint folder; None serves the embedded demo model.
        config: a ready EngineConfig, instead of `model` and `**kwargs`.
        served_model_name: the model's name, or a list of names (aliases); the first is
            reported in responses and metrics, and all are accepted in requests. Default:
            the checkpoint folder's name (`models/qwen` is "qwen"), or "conveyor-demo".
        log_stats_interval_s: seconds between throughput log lines while busy (0: never).
        max_waiting_requests: most sequences that may wait for admission before
            `check_admission` refuses more; None: one per KV block, at least max_num_seqs.
        engine_process: run the engine in a child process (EngineProcess) instead of a
            thread of this one, so that streaming work here never holds up a step through
            the GIL (`conveyor serve` does). `engine` is then None.
        engine_stall_timeout_s: seconds the engine may make no step while requests are in
            flight before it counts as hung (None: never). Progress, not liveness:
        engine_heartbeat_timeout_s: with engine_process, seconds an engine process may send
            nothing, not even the beat it sends every second whatever its step does, before
            it counts as stopped or dead-locked: it is killed and the engine is dead (a
            data-parallel replica is restarted). None: never.
        max_replica_restarts: with data_parallel_size > 1, how many times each replica whose
            engine died is restarted before the whole engine counts as dead.
        **kwargs: any EngineConfig field, as for `LLM`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        served_model_name: str | Sequence[str] | None = None,
        log_stats_interval_s: float = 5.0,
        max_waiting_requests: int | None = None,
        engine_process: bool = False,
        engine_stall_timeout_s: float | None = None,
        engine_heartbeat_timeout_s: float | None = 10.0,
        max_replica_restarts: int = 3,
        **kwargs: Any,
    ) -> None:
        if config is None:
            config = EngineConfig(model=model, **kwargs)
        elif model is not None or kwargs:
            raise ValueError("Give either config or model and EngineConfig fields, not both.")
        num_replicas = config.data_parallel_size
        callbacks = {
            "emit": lambda outputs, stats, replica=0: self._post(
                self._on_step, outputs, stats, replica
            ),
            "reject": lambda request_id, exc: self._post(self._reject, request_id, exc),
            "on_dead": self._on_dead,
        }
        replica_options = {
            "on_replica_dead": self._on_replica_dead,
            "on_replica_restarted": lambda replica: self._post(self._wake, replica),
            "max_replica_restarts": max_replica_restarts,
        }
        started = start_engine(
            config, engine_process, callbacks, self._wake, replica_options,
            heartbeat_timeout_s=engine_heartbeat_timeout_s,
        )  # fmt: skip
        self._core: EngineClient = started.core
        self.engine: LLMEngine | None = started.engine
        self.model_path, self.limits = started.model_path, started.limits
        self.tokenizer = started.tokenizer
        # What the server's grammar checks allow (structured/grammar_checker.py).
        self.grammar_compile_timeout = config.grammar_compile_timeout
        self.pooling = started.pooling  # a PoolingConfig: how embedding requests pool
        self.max_model_len = self.limits.max_model_len
        self.vocab_size = self.limits.vocab_size
        self.served_model_names = served_model_names(served_model_name, config.model)
        self.model_name = self.served_model_names[0]
        self.metrics: EngineMetrics | DataParallelMetrics
        if num_replicas > 1:
            self.metrics = DataParallelMetrics(self.model_name, log_stats_interval_s, num_replicas)
            self._replica_metrics = self.metrics.replicas
        else:
            self.metrics = EngineMetrics(self.model_name, log_stats_interval_s)
            self._replica_metrics = [self.metrics]
        if max_waiting_requests is None:  # the engine resolved num_kv_blocks (per replica)
            per_replica = max(config.num_kv_blocks or 1, config.max_num_seqs)
            max_waiting_requests = per_replica * num_replicas
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}.")
        self.max_waiting_requests = max_waiting_requests
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None
        self._stopping = False
        self._shut_down = False
        self._ids = itertools.count()
        # One per replica: a replica that stops stepping is hung even while others step.
        self._heartbeats = [Heartbeat(engine_stall_timeout_s) for _ in range(num_replicas)]
        self._heartbeat = self._heartbeats[0]
        self._watchdog: asyncio.Task[None] | None = None
        # Called with (request_id, prompt ids, params) before generate() queues a request;
        # it may raise to refuse it (the server's per-client limits, server/admission.py).
        self.before_add: Callable[[str, list[int], SamplingParams], None] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLM:
        """Build from a ready EngineConfig (kwargs: the other arguments of __init__)."""
        return cls(config=config, **kwargs)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the engine thread, outputs to the running loop (generate() does it too)."""
        self._ensure_started()

    def _ensure_started(self) -> None:
        if not self._core.started and not self._stopping:
            self._loop = asyncio.get_running_loop()
            self._core.start()
            if self._heartbeat.timeout_s is not None:
                self._watchdog = self._loop.create_task(self._watch())

    @property
    def dead(self) -> bool:
        """The engine failed for good (its process died, or its thread ended on an error)."""
        return self._dead is not None

    def check_health(self) -> None:
        """Raise EngineNotRunningError unless the loop can serve requests."""
        if self._dead is not None:
            raise EngineNotRunningError(f"The engine failed and stopped: {self._dead!r}")
        if self._stopping:
            raise EngineNotRunningError("The server is shutting down.")
        hung = self._hung
        if hung is not None:
            raise EngineNotRunningError(hung)
        if self._core.started and not self._core.alive:
            raise EngineNotRunningError("The engine loop has stopped.")
        if self.num_serving_replicas == 0:
            raise EngineNotRunningError(
                f"None of the {self.num_replicas} data-parallel replicas serves right now (their "
                "engines died and are restarting); retry shortly."
            )

    @property
    def num_replicas(self) -> int:
        """Engine replicas behind this AsyncLLM (data_parallel_size)."""
        return len(self._heartbeats)

    @property
    def num_serving_replicas(self) -> int:
        """Replicas that take new requests: all but those restarting after their engine died
        (0 once the engine is dead)."""
        if self._dead is not None:
            return 0
        return getattr(self._core, "num_serving", self.num_replicas)

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop admitting requests; abort the ones still running after `grace_s` seconds."""
        self._stopping = True
        self._core.abort_all_at(time.monotonic() + max(0.0, grace_s), _SHUTDOWN_REASON)

    async def shutdown(self) -> None:
        """Abort every request (their streams end with finish_reason "abort"), stop the
        engine thread (or processes) and an in-process engine's tensor-parallel workers.
        Idempotent: a second call returns at once."""
        if self._shut_down:
            return
        self._shut_down = True
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        # The thread emits the aborts before it ends; they reach the loop before this await.
        # A hung engine gets a moment only: it would not answer.
        timeout = 2.0 if self._hung is not None else 60.0
        stop = functools.partial(self._core.stop, _SHUTDOWN_REASON, timeout)
        await asyncio.get_running_loop().run_in_executor(None, stop)
        if self.engine is not None:  # its workers and process group (none without TP)
            self.engine.shutdown()
        await asyncio.sleep(0)
        self._fail_all(EngineNotRunningError("The engine has shut down."))

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    @property
    def num_unfinished_requests(self) -> int:
        """Requests whose stream has not ended yet (queued, waiting or running)."""
        return len(self._streams)

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences not yet running: queued for the loop plus the scheduler's waiting ones."""
        return self._core.num_waiting_seqs

    # ------------------------------------------------------------------ requests
    def check_admission(self, num_seqs: int = 1) -> None:
        """Before generate(): EngineOverloadedError if `num_seqs` more sequences would make
        more than `max_waiting_requests` wait (an empty queue admits any size),
        EngineNotRunningError if the engine is dead or shutting down."""
        self.check_health()
        waiting = self.num_waiting_seqs
        if waiting and waiting + num_seqs > self.max_waiting_requests:
            raise EngineOverloadedError(
                f"The server is overloaded: {waiting} sequences are waiting "
                f"(at most {self.max_waiting_requests}). Retry later."
            )

    def check_prompt(
        self, prompt_ids: list[int], params: SamplingParams, strict: bool = False
    ) -> None:
        """Raise PromptError (a ValueError) if this prompt can never run (read-only; safe
        during a step). `strict`: a max_tokens beyond the context is an error, not clamped
        (see core/limits.py)."""
        self.limits.check(prompt_ids, params, strict)

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request now and return its stream of delta outputs.

        Each output holds the text, token ids and logprobs that are new since the previous
        one; the last has `finished=True`. Leaving the iteration early (or its task being
        cancelled, e.g. the client went away) aborts the request. Must be called from the
        event loop's thread.

        Args:
            prompt: text, or token ids.
            params: sampling parameters.
            request_id: unique id (generated when None).
            prompt_token_ids: the tokens of a text prompt, if already tokenized.
            arrival_time: when the request arrived (time.monotonic(); default now): its
                deadline and latency metrics count from then (the server's own work on it,
                such as checking its output constraint, included).
            tenant: whose request it is (None: `params.tenant`); tenants share each step's
                time (core/tenant_shares.py).
        Returns:
            An async iterator of RequestOutput deltas; it raises RequestFailedError if the
            engine failed the request, EngineNotRunningError if the engine stopped.
        Raises:
            ValueError: a duplicate id or a prompt that can never run.
            EngineNotRunningError: the engine is dead or shutting down.
        """
        self.check_health()
        self._ensure_started()
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        if not self._streams:  # work arrives at an idle engine: its silence counts from now
            for heartbeat in self._heartbeats:
                heartbeat.beat(time.monotonic())
        if isinstance(prompt, str):
            ids = list(prompt_token_ids or self.tokenizer.encode(prompt))
        else:
            ids = list(prompt)
        if tenant is not None and tenant != params.tenant:
            params = replace(params, tenant=tenant)
        self.limits.check(ids, params)
        if self.before_add is not None:
            self.before_add(request_id, ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(
            request_id, arrival, prompt if isinstance(prompt, str) else None, ids,
            self._abort_soon,
        )  # fmt: skip
        self._streams[request_id] = stream
        try:
            self._core.add(request_id, prompt, ids, params, stream.arrival_time)
        except BaseException:  # no replica serves (they all died since check_health)
            del self._streams[request_id]
            raise
        return stream.outputs()

    async def abort(self, request_id: str) -> None:
        """End a request with finish_reason "abort" and free its blocks; its stream gets a
        final output. Unknown or finished ids are ignored."""
        self._abort_soon(request_id, abandoned=False)

    def abort_open(self, request_ids: Sequence[str]) -> None:
        """Abort those of `request_ids` whose stream is still open (nobody reads them any
        more); finished and unknown ids are skipped without a message to the engine."""
        for request_id in request_ids:
            if request_id in self._streams:
                self._abort_soon(request_id)

    def _abort_soon(self, request_id: str, abandoned: bool = True) -> None:
        """Queue an abort for the engine; `abandoned`: nobody reads the stream any more."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.abandoned:
            stream.abandoned = abandoned
            self._core.abort(request_id)

    # ------------------------------------------------------------------ from the thread
    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback(*args)` on the event loop (called from the engine thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(callback, *args)  # type: ignore[union-attr]

    def _on_dead(self, exc: BaseException) -> None:
        if self._dead is None and not self._shut_down:
            logger.error("The engine is dead: %s", exc)
        self._dead = exc
        self._post(self._fail_all, EngineNotRunningError(f"The engine failed and stopped: {exc!r}"))

    def _on_replica_dead(self, replica: int, request_ids: list[str], exc: BaseException) -> None:
        """Data-parallel replica `replica` died and is being restarted (its reader thread):
        the requests it held end with an error; the other replicas' go on."""
        error = EngineNotRunningError(
            f"Data-parallel replica {replica} failed and is restarting, so this request "
            f"ended; retry it. ({str(exc).rstrip('.')})"
        )
        self._post(self._fail_requests, replica, request_ids, error)

    def _fail_requests(self, replica: int, request_ids: list[str], exc: BaseException) -> None:
        self.metrics.record_replica_restart(replica)  # type: ignore[union-attr]
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.queue.put_nowait(exc)

    def _reject(self, request_id: str, exc: ValueError) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.queue.put_nowait(exc)

    def _wake(self, replica: int) -> None:
        """A request went to an idle replica: its silence counts from now (on the loop)."""
        self._heartbeats[replica].beat(time.monotonic())

    @property
    def _hung(self) -> str | None:
        """Why the engine (a replica of it) counts as hung, or None."""
        return next((hb.hung for hb in self._heartbeats if hb.hung is not None), None)

    def _on_step(self, outputs: list[RequestOutput], stats: StepStats, replica: int = 0) -> None:
        """Hand one step's deltas (of replica `replica`) to their streams and account them."""
        now = time.monotonic()
        heartbeat, metrics = self._heartbeats[replica], self._replica_metrics[replica]
        if heartbeat.hung is not None:
            logger.warning("The engine steps again: it is healthy.")
        heartbeat.beat(now)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            out.prompt, out.prompt_token_ids = stream.prompt, stream.prompt_token_ids
            stream.last_token_time = metrics.record_output(
                out, len(stream.prompt_token_ids), stream.last_token_time, now
            )
            if out.finished:
                del self._streams[out.request_id]
            if not stream.abandoned:
                stream.queue.put_nowait(out)
        metrics.record_step(
            stats.num_tokens, stats.num_running, stats.num_waiting, stats.kv_usage,
            stats.num_preemptions, stats.step_time_s,
            stats.prefix_cache_queries, stats.prefix_cache_hits,
        )  # fmt: skip
        metrics.maybe_log(now)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(exc)

    def _in_flight(self, replica: int) -> list[str]:
        """The unfinished requests that replica `replica` holds."""
        if len(self._heartbeats) == 1:
            return list(self._streams)
        replica_of = self._core.router.replica_of  # type: ignore[attr-defined]
        return [rid for rid in self._streams if replica_of(rid) == replica]

    async def _watch(self) -> None:
        """The watchdog: end the in-flight requests of a hung engine (see heartbeat.py); with
        replicas, those of the hung replica."""
        while True:
            await asyncio.sleep(self._heartbeat.poll_interval_s)
            for replica, heartbeat in enumerate(self._heartbeats):
                ids = self._in_flight(replica)
                if not heartbeat.check(time.monotonic(), len(ids)):
                    continue
                where = f" (data-parallel replica {replica})" if len(self._heartbeats) > 1 else ""
                logger.error(
                    "%s%s Ending its in-flight requests with an error; /health answers 503 "
                    "until it steps again.",
                    heartbeat.hung,
                    where,
                )
                error = EngineNotRunningError(heartbeat.hung)
                for request_id in ids:
                    stream = self._streams.pop(request_id)
                    stream.queue.put_nowait(error)
                for request_id in ids:  # if it ever resumes, it frees their blocks
                    self._core.abort(request_id)

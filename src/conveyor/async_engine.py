"""AsyncLLM: one background asyncio task drives LLMEngine; each request gets its own stream.

    generate() ──► pending adds ─┐                 ┌─► worker thread: engine.step()
    abort()    ──► pending aborts┴─► loop task ────┤   (the event loop keeps serving HTTP)
        ▲                                          └─► dispatch: delta outputs to each
        └───────────── per-request asyncio.Queue ◄───── request's queue, metrics

Invariant: only the loop task touches the engine's mutable state, and only between steps
(adds, aborts) or through the single worker thread (one step at a time). Callers only make
read-only checks (tokenizer, `check_prompt`). Requests therefore join and leave between steps.
An exception inside a step fails the requests that step scheduled and the loop goes on; only an
error the loop cannot recover from makes the engine dead (`check_health` raises).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from conveyor.config import EngineConfig
from conveyor.engine import LLMEngine
from conveyor.metrics import EngineMetrics
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "conveyor-demo"


class EngineNotRunningError(RuntimeError):
    """The engine loop is dead, stopped or shutting down: no request can run (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """The request failed inside the engine (the step it was in raised); HTTP 500."""


@dataclass(slots=True)
class _Stream:
    arrival_time: float
    num_prompt_tokens: int
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    last_token_time: float | None = None
    abandoned: bool = False  # its consumer left; kept until the abort's output is counted


class AsyncLLM:
    """Serve many concurrent requests from one engine, streaming deltas as they are made.

    Args:
        model: a Hugging Face checkpoint folder; None serves the embedded demo model.
        config: a ready EngineConfig, instead of `model` and `**kwargs`.
        served_model_name: the name reported in metrics (default: `model`, or
            "conveyor-demo").
        log_stats_interval_s: seconds between throughput log lines while busy (0: never).
        **kwargs: any EngineConfig field, as for `LLM`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        served_model_name: str | None = None,
        log_stats_interval_s: float = 5.0,
        **kwargs: Any,
    ) -> None:
        if config is None:
            config = EngineConfig(model=model, **kwargs)
        elif model is not None or kwargs:
            raise ValueError("Give either config or model and EngineConfig fields, not both.")
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.runner.vocab_size
        self.model_path = self.engine.model_path
        self.model_name = served_model_name or config.model or DEMO_MODEL_NAME
        self.metrics = EngineMetrics(self.model_name, log_stats_interval_s)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="conveyor-step")
        self._streams: dict[str, _Stream] = {}
        self._pending_adds: list[tuple[str, str | list[int], list[int], SamplingParams]] = []
        self._pending_aborts: list[str] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None
        self._stopping = False
        self._abort_deadline: float | None = None
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLM:
        """Build from a ready EngineConfig (kwargs: served_model_name, log_stats_interval_s)."""
        return cls(config=config, **kwargs)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the background loop on the running event loop (generate() also does)."""
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._task is None and not self._stopping:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="conveyor-loop")

    def check_health(self) -> None:
        """Raise EngineNotRunningError unless the loop can serve requests."""
        if self._dead is not None:
            raise EngineNotRunningError(f"The engine failed and stopped: {self._dead!r}")
        if self._stopping:
            raise EngineNotRunningError("The server is shutting down.")
        if self._task is not None and self._task.done():
            raise EngineNotRunningError("The engine loop has stopped.")

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop admitting requests; abort the ones still running after `grace_s` seconds."""
        self._stopping = True
        self._abort_deadline = time.monotonic() + max(0.0, grace_s)
        self._wakeup.set()

    async def shutdown(self) -> None:
        """Abort every request (their streams end with finish_reason "abort"), stop the loop."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # A step may still run in the worker thread: wait for it before touching the engine.
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        if self._dead is None:
            self._apply_pending()
            self._dispatch(self.engine.abort_request(list(self._streams)))
        self._fail_all(EngineNotRunningError("The engine has shut down."))

    # ------------------------------------------------------------------ requests
    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this prompt can never run (read-only; safe during a step)."""
        self.engine.check_prompt(prompt_ids, params)

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
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
        if isinstance(prompt, str):
            ids = list(prompt_token_ids or self.tokenizer.encode(prompt))
        else:
            ids = list(prompt)
        self.engine.check_prompt(ids, params)
        stream = _Stream(time.monotonic(), len(ids))
        self._streams[request_id] = stream
        self._pending_adds.append((request_id, prompt, ids, params))
        self._wakeup.set()
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.error is not None:
                    done = True
                    raise RequestFailedError(item.error)
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:  # the consumer left early: free the request's blocks
                self._abort_soon(request_id)

    async def abort(self, request_id: str) -> None:
        """End a request with finish_reason "abort" and free its blocks; its stream gets a
        final output. Unknown or finished ids are ignored.

        Args:
            request_id: the id given to (or made by) generate().
        """
        stream = self._streams.get(request_id)
        if stream is not None and not stream.abandoned:
            self._pending_aborts.append(request_id)
            self._wakeup.set()

    def _abort_soon(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.abandoned:
            stream.abandoned = True
            self._pending_aborts.append(request_id)
            self._wakeup.set()

    # ------------------------------------------------------------------ loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            while True:
                self._apply_pending()
                deadline = self._abort_deadline
                if deadline is not None and time.monotonic() >= deadline and self._streams:
                    n = len(self._streams)
                    logger.warning("Shutdown grace period is over: aborting %d requests.", n)
                    self._dispatch(engine.abort_request(list(self._streams)))
                if not engine.has_unfinished_requests():
                    # Every stream's request is in the engine once pending adds are applied.
                    self._fail_all(RequestFailedError("The engine lost this request."))
                    self._record_state()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                try:
                    outputs = await loop.run_in_executor(self._executor, engine.step)
                except Exception as exc:
                    outputs = self._fail_step(exc)
                self._dispatch(outputs)
                self._record_state(engine.last_step_num_tokens)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the loop cannot go on: the engine is dead
            logger.exception("The engine loop failed; the engine is dead.")
            self._dead = exc
            self._fail_all(EngineNotRunningError(f"The engine failed and stopped: {exc!r}"))

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for request_id, prompt, ids, params in adds:
            stream = self._streams.get(request_id)
            if stream is None or stream.abandoned:  # its consumer already left
                self._streams.pop(request_id, None)
                continue
            try:
                self.engine.add_request(
                    request_id,
                    prompt,
                    params,
                    arrival_time=stream.arrival_time,
                    stream=True,
                    prompt_token_ids=ids,
                    delta=True,
                )
            except ValueError as exc:
                del self._streams[request_id]
                stream.queue.put_nowait(exc)
        aborts, self._pending_aborts = self._pending_aborts, []
        if aborts:
            self._dispatch(self.engine.abort_request(aborts))

    def _fail_step(self, exc: Exception) -> list[RequestOutput]:
        """Fail the requests of the step that raised; the others keep running."""
        logger.exception("An engine step failed; failing the requests it scheduled.")
        outputs = self.engine.abort_step()
        message = f"The engine failed while running this request ({type(exc).__name__})."
        for out in outputs:
            out.error = message
        return outputs

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.last_token_time = self.metrics.record_output(
                out, stream.num_prompt_tokens, stream.last_token_time, now
            )
            if out.finished:
                del self._streams[out.request_id]
            if not stream.abandoned:
                stream.queue.put_nowait(out)

    def _record_state(self, num_tokens: int = 0) -> None:
        sched = self.engine.scheduler
        self.metrics.record_step(
            num_tokens, sched.num_running, sched.num_waiting, sched.kv_usage, sched.num_preemptions
        )
        self.metrics.maybe_log(time.monotonic())

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        self._pending_adds.clear()
        for stream in streams.values():
            stream.queue.put_nowait(exc)

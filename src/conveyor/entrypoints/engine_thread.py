"""EngineThread: one thread steps LLMEngine back to back, so no step waits for the event loop.

    callers (the event loop)            engine thread
    add() / abort() ──► inbox ─────────► between steps: apply the adds, then the aborts
    abort_all_at(t) ───────────────────► from t on: abort whatever is left
                                         step() ──► emit(outputs, stats): the caller hands
                                         idle: sleep until the inbox     them to its loop
                                               gets something
    stop() ─────────────────────────────► after the current step: abort the rest, emit, exit

Only this thread changes the engine while it runs; callers may make read-only checks
(tokenizer, check_prompt, queue lengths). A step that raises fails the requests it
scheduled (their outputs carry `error`) and the thread goes on; an error even that recovery
cannot handle ends the thread and is reported to `on_dead`.

The thread that steps the engine must be the one that built it (`build`, or `run` in the
building thread): libgomp keeps a pool of OpenMP workers for every thread that starts
parallel regions, and once two pools exist in a process with as many workers as cores, it
counts the machine as oversubscribed and lets idle workers spin a throttled ~1,000 times
instead of GOMP_SPINCOUNT before they sleep, so each of a step's hundreds of parallel
regions pays a futex wake-up: a token takes two to three times as long
(docs/kernels.md#measured-choices).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.entrypoints.engine_client import StepStats
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineThread:
    """The in-process EngineClient: a daemon thread steps the engine.

    Args:
    engine: the engine this thread owns once started.
    emit: called (in this thread) after every step and every applied batch of aborts.
    reject: called (in this thread) with a request id whose add raised ValueError.
    on_dead: called (in this thread) with the error that ended the thread.
    """

    def __init__(
        self,
        engine: LLMEngine,
        emit: Callable[[list[RequestOutput], StepStats], None],
        reject: Callable[[str, ValueError], None],
        on_dead: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self._emit, self._reject, self._on_dead = emit, reject, on_dead
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._final_reason: str | None = None
        self._abort_at: float | None = None
        self._abort_reason: str | None = None
        # Sequences added by callers and applied by this thread; each counter has one writer.
        self._queued_seqs = 0
        self._applied_seqs = 0
        self._thread = threading.Thread(target=self.run, name="conveyor-engine", daemon=True)
        self._go: threading.Event | None = None  # set by build(): its thread waits for start()
        # Tensor-parallel: a worker's death wakes this thread, which then ends (see run).
        self._tp = getattr(getattr(engine, "runner", None), "tp", None)
        if self._tp is not None:
            self._tp.on_failure.append(self._wakeup.set)

    @classmethod
    def build(
        cls,
        factory: Callable[[], LLMEngine],
        emit: Callable[[list[RequestOutput], StepStats], None],
        reject: Callable[[str, ValueError], None],
        on_dead: Callable[[BaseException], None],
    ) -> EngineThread:
        """An EngineThread whose thread builds the engine with `factory()` now (blocking;
        whatever it raises is raised here) and steps it once `start()` is called."""
        built: queue.SimpleQueue[EngineThread | BaseException] = queue.SimpleQueue()
        go = threading.Event()

        def body() -> None:
            try:
                core = cls(factory(), emit, reject, on_dead)
            except BaseException as exc:
                built.put(exc)
                return
            core._thread, core._go = threading.current_thread(), go
            built.put(core)
            go.wait()
            if not core._stopping:
                core.run()

        threading.Thread(target=body, name="conveyor-engine", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    @property
    def started(self) -> bool:
        return self._thread.ident is not None if self._go is None else self._go.is_set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_queued_seqs(self) -> int:
        """Sequences added but not yet handed to the engine."""
        return self._queued_seqs - self._applied_seqs

    @property
    def applied_seqs(self) -> int:
        """Sequences handed to the engine so far (read in this thread's callbacks)."""
        return self._applied_seqs

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences not yet running: queued here plus the scheduler's waiting ones."""
        return self.engine.scheduler.num_waiting + self.num_queued_seqs

    def start(self) -> None:
        if self._go is not None:
            self._go.set()
        else:
            self._thread.start()

    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        """Queue a request for the engine (it joins before the next step)."""
        self._queued_seqs += params.n
        self._inbox.append((request_id, prompt, prompt_ids, params, arrival_time))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Queue an abort (applied before the next step, after any queued add)."""
        self._inbox.append((request_id,))
        self._wakeup.set()

    def abort_all_at(self, when: float, reason: str) -> None:
        """From `when` (time.monotonic) on, abort every request with `reason`."""
        self._abort_reason, self._abort_at = reason, when
        self._wakeup.set()

    def stop(self, final_reason: str | None = None, timeout_s: float | None = None) -> None:
        """Blocking: finish the current step, abort what is left with `final_reason`, emit
        it, and end the thread (waiting at most `timeout_s`; None: as long as it takes)."""
        self._final_reason = final_reason
        self._stopping = True
        self._wakeup.set()
        if self._go is not None:
            self._go.set()  # a built thread never started ends without stepping
        if self.started:
            self._thread.join(timeout_s)

    def run(self) -> None:
        """The step loop, in the calling thread (what `start()` runs in this object's thread);
        returns once stopped, or once the engine died (after `on_dead`)."""
        engine = self.engine
        try:
            while not self._stopping:
                if self._tp is not None and self._tp.failure is not None:
                    raise self._tp.failure
                outputs = self._apply_inbox()
                at = self._abort_at
                if at is not None and time.monotonic() >= at and engine.has_unfinished_requests():
                    ids = engine.unfinished_request_ids()
                    logger.warning("Shutdown grace period is over: aborting %d requests.", len(ids))
                    outputs += engine.abort_request(ids, self._abort_reason)
                num_tokens, step_time = 0, 0.0
                hold = engine.scheduler.hold_s() if not self._inbox else 0.0
                if hold > 0:  # only long prompts are left: the next request may be near
                    self._wakeup.clear()
                    if not self._inbox:
                        self._wakeup.wait(hold)
                    outputs += self._apply_inbox()
                if engine.has_unfinished_requests():
                    start = time.monotonic()
                    try:
                        outputs += engine.step()
                    except Exception as exc:
                        if getattr(exc, "fatal", False):  # a tensor-parallel rank is gone
                            raise
                        outputs += self._fail_step(exc)
                    step_time = time.monotonic() - start
                    num_tokens = engine.last_step_num_tokens
                self._emit(outputs, self._stats(num_tokens, step_time))
                if not engine.has_unfinished_requests() and not self._inbox:
                    now = time.monotonic()
                    timeout = at - now if at is not None and at > now else None
                    self._wakeup.wait(timeout)
                    self._wakeup.clear()
            outputs = self._apply_inbox()
            outputs += engine.abort_request(engine.unfinished_request_ids(), self._final_reason)
            self._emit(outputs, self._stats(0))
        except BaseException as exc:  # the thread cannot go on: the engine is dead
            logger.exception("The engine thread failed; the engine is dead.")
            self._on_dead(exc)

    def _apply_inbox(self) -> list[RequestOutput]:
        aborts = []
        while self._inbox:
            item = self._inbox.popleft()
            if len(item) == 1:
                aborts.append(item[0])
                continue
            request_id, prompt, ids, params, arrival_time = item
            self._applied_seqs += params.n
            try:
                self.engine.add_request(
                    request_id, prompt, params, arrival_time=arrival_time, stream=True,
                    prompt_token_ids=ids, delta=True,
                )  # fmt: skip
            except ValueError as exc:
                self._reject(request_id, exc)
        return self.engine.abort_request(aborts) if aborts else []

    def _fail_step(self, exc: Exception) -> list[RequestOutput]:
        """Fail the requests of the step that raised; the others keep running."""
        logger.exception("An engine step failed; failing the requests it scheduled.")
        outputs = self.engine.abort_step()
        message = f"The engine failed while running this request ({type(exc).__name__})."
        for out in outputs:
            out.error = message
        return outputs

    def _stats(self, num_tokens: int, step_time_s: float = 0.0) -> StepStats:
        s = self.engine.scheduler
        bm = s.block_manager
        return StepStats(
            num_tokens, s.num_running, s.num_waiting, s.kv_usage, s.num_preemptions, step_time_s,
            bm.prefix_cache_queries, bm.prefix_cache_hits,
        )  # fmt: skip

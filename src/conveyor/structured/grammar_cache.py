"""GrammarCache: compiled grammars by constraint, compiled in two lanes under a time limit.

    get(so)        a CompileJob (its `future` holds the CompiledGrammar): a cache hit, or a
                   new job queued on its lane. small lane: what the server's checks estimated
                   cheap to compile (so.compile_cost), or without an estimate specs of up to
                   SMALL_SPEC_CHARS characters; big lane: the rest. So a cheap grammar never
                   queues behind a costly one.
    release(job)   one request stopped waiting (aborted, abandoned, expired); a job nobody
                   waits for that has not started is cancelled.
    poll(now)      the engine calls it every step while grammars are pending. A compile
                   running past `timeout_s` fails its job (GrammarTimeoutError: the request's
                   400). A lane whose compile runs past the lane's budget (SMALL_BUDGET_S, or
                   the time limit for the big lane) hands that thread over as "overtime" and
                   starts its next job in a new thread; at most MAX_OVERTIME per lane.

Each lane has one thread at a time, plus its overtime ones: four compile threads at most,
each ending when its lane has nothing queued. xgrammar cannot stop a compile once it
started, so a timed-out one runs on in its thread;
nobody waits for it, and its result, if it comes, is kept (a retry then hits the cache). A
constraint that timed out fails at once when asked again (until its result arrives or it
leaves the cache). The limits of structured/limits.py keep such compiles rare.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.structured.grammar import (
    SMALL_SPEC_CHARS,
    GrammarTimeoutError,
    GrammarUnsatisfiableError,
    build_checked,
    can_start,
)
from conveyor.structured.grammar_bounds import CHEAP_COMPILE_COST
from conveyor.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

SMALL_BUDGET_S = 0.5
MAX_OVERTIME = 1


@dataclass(eq=False, slots=True)
class CompileJob:
    """One constraint's compile. `waiters`: requests waiting for it now."""

    so: StructuredOutputsParams
    lane: _Lane
    future: Future[Any] = field(default_factory=Future)
    waiters: int = 0
    started_at: float | None = None


@dataclass(eq=False, slots=True)
class _Worker:
    job: CompileJob | None = None
    overtime: bool = False


@dataclass(eq=False, slots=True)
class _Lane:
    name: str
    budget_s: float
    queue: deque[CompileJob] = field(default_factory=deque)
    active: _Worker | None = None
    overtime: list[_Worker] = field(default_factory=list)


def _cheap(so: StructuredOutputsParams) -> bool:
    """For the small lane: a cost the server estimated cheap, else (none estimated: LLM's
    requests, json_object) a short spec."""
    if so.compile_cost is not None:
        return so.compile_cost <= CHEAP_COMPILE_COST
    return len(so.spec) <= SMALL_SPEC_CHARS


class GrammarCache:
    """Compiles grammars in two lanes of threads, keeping the latest `max_entries`.

    Args:
        hf_tokenizer: the transformers tokenizer the model's tokens come from.
        vocab_size: the width of the model's logits (it may exceed the tokenizer's size; the
            extra ids are never allowed).
        stop_token_ids: tokens that end a request where the grammar is complete.
        timeout_s: a compile running longer fails its requests (GrammarTimeoutError).
        max_entries: compiled grammars kept (least recently used dropped first).
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        timeout_s: float = 5.0,
        max_entries: int = 256,
    ) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.timeout_s = timeout_s
        self._max_entries = max_entries
        self._compiler: xgr.GrammarCompiler | None = None  # built on first use, in a lane
        self._jobs: OrderedDict[tuple[str, str, bool], CompileJob] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()  # building the compiler (once) takes a while
        self._small = _Lane("small", min(SMALL_BUDGET_S, timeout_s))
        self._big = _Lane("big", timeout_s)
        self.num_queries = 0
        self.num_hits = 0
        self.num_compiles = 0
        self.num_timeouts = 0
        self.compile_time_s = 0.0  # total seconds spent compiling

    # ------------------------------------------------------------------ the engine's side
    def get(self, so: StructuredOutputsParams) -> CompileJob:
        """The compile job of `so` (its future done at once on a cache hit); one more
        request waits for it until it is done or `release`d."""
        key = so.key
        with self._lock:
            self.num_queries += 1
            job = self._jobs.get(key)
            if job is not None and self._reusable(job):
                self.num_hits += 1
                self._jobs.move_to_end(key)
            else:
                lane = self._small if _cheap(so) else self._big
                job = CompileJob(so, lane)
                self._jobs[key] = job
                lane.queue.append(job)
                if lane.active is None:
                    self._start_worker(lane)
                while len(self._jobs) > self._max_entries:
                    self._jobs.popitem(last=False)
            job.waiters += 1
            return job

    @staticmethod
    def _reusable(job: CompileJob) -> bool:
        """A job still running, compiled, or timed out (a retry fails at once)."""
        future = job.future
        if future.cancelled():
            return False
        if not future.done():
            return True
        exc = future.exception()
        return exc is None or isinstance(exc, GrammarTimeoutError)

    def release(self, job: CompileJob) -> None:
        """One request no longer waits for `job`; with none left, a queued job is cancelled."""
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.started_at is not None or not job.future.cancel():
                return
            if job in job.lane.queue:
                job.lane.queue.remove(job)
            key = job.so.key
            if self._jobs.get(key) is job:
                del self._jobs[key]

    def poll(self, now: float | None = None) -> None:
        """Fail compiles past the time limit; hand lanes stuck past their budget over."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for lane in (self._small, self._big):
                w = lane.active
                if (
                    w is not None and w.job is not None and w.job.started_at is not None
                    and now - w.job.started_at >= lane.budget_s
                    and len(lane.overtime) < MAX_OVERTIME
                ):  # fmt: skip
                    w.overtime = True
                    lane.overtime.append(w)
                    lane.active = None
                    if lane.queue:
                        self._start_worker(lane)
                workers = lane.overtime + ([lane.active] if lane.active is not None else [])
                for w in workers:
                    job = w.job
                    if job is None or job.started_at is None or job.future.done():
                        continue
                    if now - job.started_at >= self.timeout_s:
                        self.num_timeouts += 1
                        job.future.set_exception(
                            GrammarTimeoutError(
                                f"structured_outputs.{job.so.kind} did not compile within "
                                f"grammar_compile_timeout ({self.timeout_s:g} s); send a "
                                "smaller or simpler constraint (or raise the server's "
                                "--grammar-compile-timeout)."
                            )
                        )

    @property
    def busy(self) -> bool:
        """Some compile is queued or running."""
        lanes = (self._small, self._big)
        return any(lane.queue or lane.active or lane.overtime for lane in lanes)

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    def shutdown(self) -> None:
        """Cancel the queued compiles; running ones end on their own (the process's exit
        waits for them: limits keep them to seconds)."""
        with self._lock:
            for lane in (self._small, self._big):
                while lane.queue:
                    lane.queue.popleft().future.cancel()

    # ------------------------------------------------------------------ the lanes' side
    def _start_worker(self, lane: _Lane) -> None:
        """Give `lane` a new active thread (the lock is held)."""
        worker = _Worker()
        lane.active = worker
        name = f"conveyor-grammar-{lane.name}"
        # Not a daemon: Python waits for it at exit. A daemon thread whose compile returns while
        # the interpreter finalizes is ended by pthread_exit inside xgrammar's C++ frames,
        # which aborts the process ("terminate called without an active exception").
        threading.Thread(target=self._work, args=(lane, worker), name=name).start()

    def _next_job(self, lane: _Lane, worker: _Worker) -> CompileJob | None:
        """The worker's next job, or None when it should end (the lock is held)."""
        worker.job = None
        if worker.overtime:
            lane.overtime.remove(worker)
            return None
        while lane.queue:
            job = lane.queue.popleft()
            if job.future.set_running_or_notify_cancel():
                job.started_at = time.monotonic()
                worker.job = job
                return job
        lane.active = None
        return None

    def _work(self, lane: _Lane, worker: _Worker) -> None:
        while True:
            # The compiler first (the first time: xgrammar's import and the tokenizer info,
            # seconds for a large vocabulary): that is no job's compile time.
            compiler: Any = None
            setup_error: BaseException | None = None
            try:
                compiler = self._ensure_compiler()
            except BaseException as exc:  # every job of this worker fails with it
                setup_error = exc
            with self._lock:
                job = self._next_job(lane, worker)
            if job is None:
                return
            result: Any = None
            error: BaseException | None = setup_error
            start = time.perf_counter()
            try:
                if error is None:
                    result = self._compile(compiler, job.so)
            except BaseException as exc:  # the request's error (a bad grammar) or a fault
                error = exc
            with self._lock:
                self.num_compiles += 1
                self.compile_time_s += time.perf_counter() - start
                if not job.future.done():
                    if error is None:
                        job.future.set_result(result)
                    else:
                        job.future.set_exception(error)
                elif error is None and self._jobs.get(job.so.key) is job:
                    # It timed out, yet it finished: keep the grammar for the next request.
                    done = CompileJob(job.so, lane)
                    done.future.set_running_or_notify_cancel()
                    done.future.set_result(result)
                    self._jobs[job.so.key] = done

    def _ensure_compiler(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        with self._compiler_lock:  # the first compile of each lane may get here together
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._hf_tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None,
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(
        self, compiler: xgr.GrammarCompiler, so: StructuredOutputsParams
    ) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        grammar, shape = build_checked(so)
        compiled = compiler.compile_grammar(grammar)
        if not can_start(xgr.GrammarMatcher(compiled), self.vocab_size, shape is not None):
            raise GrammarUnsatisfiableError(
                f"structured_outputs.{so.kind} can never be satisfied: no output of this "
                "model's tokens matches it."
            )
        return compiled

"""GrammarChecker: the server's checks of output constraints, in a worker process, each
killed at its deadline, in two lanes shared fairly between clients.

    check(so, where, client)
      cached result? ──────────────────────────────────────────────► done (ok or its 400)
      same constraint in flight? wait for it
      the client's checks in flight >= max_per_client ─────────────► 429
      a child of the worker, in the express lane: the grammar built, its limits and shape
          checked, its compile cost estimated (structured/grammar_bounds.py), a frame
      cost > MAX_COMPILE_COST ───────────────────────── killed ────► 400, nothing compiled
      cost > CHEAP_COMPILE_COST: it moves to the slow lane (runs on in a free slot there,
          else is killed and queued there), where checks run as SCHED_IDLE: only on CPU the
          engine leaves idle
      it compiles for the model's vocabulary; some output must be possible
      ok: its cost goes with it to the engine, which compiles it again for its matcher in
          the lane that cost calls for (bounded: it compiled in time here)

A lane runs at most its slots of checks at once; within a lane the next check comes from the
next client in turn (round robin), so one client's many checks never hold another's, and of
that client's, the cheapest first. A check has one deadline from when it was asked for, the
engine's grammar_compile_timeout: waiting in a queue counts, and a check still running then
is killed (its CPU freed at once) and is the request's 400. An express check that runs past
EXPRESS_BUDGET_S (its estimate was wrong) moves to the slow lane the same way. Results are
cached by constraint, a timed-out one too (a retry fails at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import logging
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from conveyor.structured.grammar import GrammarError, GrammarTimeoutError
from conveyor.structured.grammar_bounds import CHEAP_COMPILE_COST, MAX_COMPILE_COST
from conveyor.structured.grammar_worker import SINGLE_THREADED_ENV, decode_frames, encode_frame
from conveyor.structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

EXPRESS_BUDGET_S = 0.5
CACHE_ENTRIES = 4096
SHUTTING_DOWN = "The server is shutting down."


class TooManyGrammarChecksError(GrammarError):
    """A client with max_per_client checks in flight already (429)."""


class GrammarCheckerUnavailableError(RuntimeError):
    """The worker process could not start (503)."""


@dataclass(eq=False)
class _Check:
    key: bytes
    so: StructuredOutputsParams
    where: str
    client: str
    deadline: float
    future: asyncio.Future[float | None]
    id: int = 0  # this run's, fresh each time it is sent (a killed run's frames never match)
    lane: str = "express"
    cost: float | None = None  # estimated compile cost, once its shape frame came
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Lane:
    slots: int
    # Per client, in turn; within a client, cheapest first (then first come): by estimated
    # cost once known (a re-run), by the constraint's length before.
    queues: OrderedDict[str, list[tuple[float, int, _Check]]] = field(default_factory=OrderedDict)
    running: dict[int, _Check] = field(default_factory=dict)
    pushed: int = 0

    def push(self, check: _Check) -> None:
        self.pushed += 1
        # Before its shape is known, a shorter constraint is the cheaper bet.
        cost = len(check.so.spec) if check.cost is None else check.cost
        heapq.heappush(self.queues.setdefault(check.client, []), (cost, self.pushed, check))

    def pop(self) -> _Check | None:
        """The next client's cheapest check (that client then goes to the back of the line)."""
        while self.queues:
            client, queue = next(iter(self.queues.items()))
            self.queues.move_to_end(client)
            if queue:
                check = heapq.heappop(queue)[2]
                if not queue:
                    del self.queues[client]
                return check
            del self.queues[client]
        return None

    def waiting(self) -> list[_Check]:
        return [item[2] for queue in self.queues.values() for item in queue]


class GrammarChecker:
    """Checks constraints in a worker process (structured/grammar_worker.py), started on the
    first check.

    Args:
        hf_tokenizer: the model's Hugging Face tokenizer (the worker gets its vocabulary).
        vocab_size: the width of the model's logits.
        stop_token_ids: tokens that end an output where the grammar is complete.
        timeout_s: a check's deadline, from when it is asked for.
        memory_mb: memory a check may take beyond the worker's own.
        workers: checks at once: one express slot, the rest (at least one) slow.
        max_per_client: checks one client may have queued or running.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        timeout_s: float,
        memory_mb: int = 1024,
        workers: int = 2,
        max_per_client: int = 8,
    ) -> None:
        self._init = {
            "op": "init", "vocab_size": vocab_size,
            "stop_ids": list(stop_token_ids), "memory_mb": memory_mb,
            "cpu_s": 1 + int(min(timeout_s, 3600)),
        }  # fmt: skip
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.max_per_client = max_per_client
        self._lanes = {"express": _Lane(1), "slow": _Lane(max(1, workers - 1))}
        # By constraint: its error (message, reason), or its estimated cost when it passed.
        self._results: OrderedDict[bytes, tuple[str, str] | float | None] = OrderedDict()
        self._inflight: dict[bytes, asyncio.Future[float | None]] = {}
        self._per_client: dict[str, int] = {}
        self._ids = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._starting: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in = bytearray()  # from the worker's result pipe
        self._out = bytearray()  # to its stdin
        self._read_fd = -1
        self._ready: asyncio.Future[None] | None = None
        self._closed = False  # close() is for good: no check runs and no worker starts after
        self.num_checks = self.num_killed = self.num_demoted = 0

    # ------------------------------------------------------------------ the server's side
    async def check(
        self, so: StructuredOutputsParams, where: str, client: str = ""
    ) -> float | None:
        """Return once `so` is known to compile in time; raise its error otherwise.

        Returns:
            Its estimated compile cost (None: json_object's, or not known).

        Raises:
            GrammarError (a ValueError: 400) or a ConstraintLimitError: refused, with the
                message the worker gave; GrammarTimeoutError: not checked in time.
            TooManyGrammarChecksError: the client has max_per_client checks in flight (429).
            GrammarCheckerUnavailableError: the worker process did not start, or the checker
                was closed (503).
        """
        if so.kind == "json_object":  # one fixed grammar: nothing a client can make slow
            return None
        if self._closed:
            raise GrammarCheckerUnavailableError(SHUTTING_DOWN)
        key = hashlib.sha256(repr(so.key).encode("utf-8", "surrogatepass")).digest()
        future = self._inflight.get(key)
        if future is None:
            if key in self._results:
                self._results.move_to_end(key)
                return _outcome(self._results[key])
            if self._per_client.get(client, 0) >= self.max_per_client:
                raise TooManyGrammarChecksError(
                    f"{where}: this client already has {self.max_per_client} output constraints "
                    "being checked; wait for them (or send ones this server has seen)."
                )
            future = await self._submit(key, so, where, client)
        return await asyncio.shield(future)

    async def _submit(
        self, key: bytes, so: StructuredOutputsParams, where: str, client: str
    ) -> asyncio.Future[float | None]:
        await self._ensure_started()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[float | None] = loop.create_future()
        future.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
        self.num_checks += 1
        check = _Check(key, so, where, client, time.monotonic() + self.timeout_s, future)
        self._inflight[key] = future
        self._per_client[client] = self._per_client.get(client, 0) + 1
        if self.timeout_s != float("inf"):
            check.timer = loop.call_at(loop.time() + self.timeout_s, self._expire, check)
        self._lanes["express"].push(check)
        self._pump()
        return future

    def close(self) -> None:
        """Kill the worker and every check it runs (nothing waits for them), for good: a
        start under way and any check asked for later fail at once (503), so no request of a
        server that stops waits for a worker that will never answer, nor starts a new one."""
        self._closed = True
        ready = self._ready
        self._stop_worker()
        if ready is not None and not ready.done():
            ready.set_exception(GrammarCheckerUnavailableError(SHUTTING_DOWN))

    def _stop_worker(self) -> None:
        """Kill the worker and fail its checks (503); the next check starts a new one."""
        proc, self._proc = self._proc, None
        if self._loop is not None and self._read_fd >= 0:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._read_fd)
                self._loop.remove_writer(proc.stdin.fileno())  # type: ignore[union-attr]
        if self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for lane in self._lanes.values():
            for check in [*lane.running.values(), *lane.waiting()]:
                self._finish(check, (SHUTTING_DOWN, "closed"), cache=False)
            lane.running.clear()
            lane.queues.clear()

    # ------------------------------------------------------------------ the worker process
    async def _ensure_started(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            if self._starting is None or self._starting.done():
                self._starting = asyncio.get_running_loop().create_task(self._start())
            await asyncio.shield(self._starting)
        if self._closed:  # between the start and this check: _pump would never send it
            raise GrammarCheckerUnavailableError(SHUTTING_DOWN)

    def _tokenizer_info(self) -> str:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            self._hf_tokenizer,
            vocab_size=self.vocab_size,
            stop_token_ids=self._init["stop_ids"] or None,
        )
        return info.serialize_json()

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if "tokenizer_info" not in self._init:  # (a vocabulary's walk: off the event loop)
            self._init["tokenizer_info"] = await asyncio.to_thread(self._tokenizer_info)
        if self._closed:  # closed while the vocabulary was read: no worker to leave behind
            raise GrammarCheckerUnavailableError(SHUTTING_DOWN)
        read_fd, write_fd = os.pipe()
        env = {**os.environ, **SINGLE_THREADED_ENV}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "conveyor.structured.grammar_worker", str(write_fd)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(write_fd,),
                env=env, start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(write_fd)
        assert proc.stdin is not None
        os.set_blocking(read_fd, False)
        os.set_blocking(proc.stdin.fileno(), False)
        self._proc, self._read_fd, self._in, self._out = proc, read_fd, bytearray(), bytearray()
        ready = self._ready = self._loop.create_future()
        self._loop.add_reader(read_fd, self._on_readable)
        self._send(self._init)
        try:
            await ready
        except GrammarCheckerUnavailableError:
            self._stop_worker()
            raise

    def _send(self, message: dict[str, Any]) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        self._out += encode_frame(message)
        self._flush()

    def _flush(self) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or self._loop is None:
            return
        fd = proc.stdin.fileno()
        try:
            while self._out:
                n = os.write(fd, self._out[: 1 << 16])
                del self._out[:n]
        except BlockingIOError:
            self._loop.add_writer(fd, self._flush)
            return
        except OSError:  # the worker is gone: _on_readable sees its pipe close
            self._out.clear()
        self._loop.remove_writer(fd)

    def _on_readable(self) -> None:
        try:
            chunk = os.read(self._read_fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self._worker_died()
            return
        self._in += chunk
        for message in decode_frames(self._in):
            self._on_message(message)

    def _worker_died(self) -> None:
        logger.error("The grammar worker process ended; it restarts on the next check.")
        ready = self._ready
        self._stop_worker()
        if ready is not None and not ready.done():
            ready.set_exception(GrammarCheckerUnavailableError(
                "Output constraints cannot be checked right now: the grammar worker did not "
                "start (see the server log)."
            ))  # fmt: skip

    def _on_message(self, message: dict[str, Any]) -> None:
        if "ready" in message or "fatal" in message:
            if "fatal" in message:
                logger.error("%s", message["fatal"])
            elif self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
            return
        check_id = int(message.get("id", -1))
        lane = next((la for la in self._lanes.values() if check_id in la.running), None)
        if lane is None:  # killed already: what it sends no longer counts
            return
        check = lane.running[check_id]
        if "work" in message:
            if check.cost is None:  # the first run's shape frame; a re-run's says the same
                self._place(check, int(message["work"]))
        elif message.get("reason") == "died":  # killed by its memory or CPU limit, most likely
            del lane.running[check_id]
            self._finish(check, (
                f"{check.where} could not be checked: {message['error']}, most likely past "
                "the memory a grammar may take on this server (--grammar-memory-limit).",
                "died",
            ))  # fmt: skip
        else:
            del lane.running[check_id]
            self._finish(check, (str(message["error"]), str(message.get("reason", "")))
                         if "error" in message else None)  # fmt: skip
        self._pump()

    # ------------------------------------------------------------------ scheduling
    def _place(self, check: _Check, work: int) -> None:
        """Its shape is known: refuse it, let it compile on, or move it to the slow lane."""
        cost = check.cost = float("inf") if work < 0 else work * self.vocab_size
        if cost > MAX_COMPILE_COST and work >= 0:
            self._kill(check)
            self._finish(check, (
                f"{check.where} is too complex to compile on this server: its estimated "
                f"compile work ({cost:.2g} position-tokens) is over {MAX_COMPILE_COST:.2g}. "
                "Long runs of optional items cost the most; make fewer of them optional.",
                "invalid",
            ))  # fmt: skip
        elif cost > CHEAP_COMPILE_COST and check.lane == "express":
            self._move_to_slow(check)

    def _pump(self) -> None:
        if self._proc is None:
            return
        now = time.monotonic()
        for name, lane in self._lanes.items():
            while len(lane.running) < lane.slots and (check := lane.pop()) is not None:
                if check.future.done():
                    continue
                if check.deadline <= now:
                    self._expire(check)
                    continue
                self._ids += 1
                check.id = self._ids
                lane.running[check.id] = check
                self._send({
                    "op": "check", "id": check.id, "kind": check.so.kind, "spec": check.so.spec,
                    "disable_any_whitespace": check.so.disable_any_whitespace,
                    "where": check.where,
                })  # fmt: skip
                if name == "express" and self._loop is not None:
                    self._loop.call_later(EXPRESS_BUDGET_S, self._demote, check, check.id)

    def _demote(self, check: _Check, run_id: int) -> None:
        """An express run past EXPRESS_BUDGET_S (its estimate was wrong, or not known yet)."""
        if check.id == run_id and check.lane == "express" and not check.future.done():
            self._move_to_slow(check)
            self._pump()

    def _move_to_slow(self, check: _Check) -> None:
        """From the express lane's running checks to the slow lane: it runs on if a slot is
        free there, else it is killed and queued there."""
        del self._lanes["express"].running[check.id]
        slow = self._lanes["slow"]
        check.lane = "slow"
        if len(slow.running) < slow.slots:
            slow.running[check.id] = check
            self._send({"op": "idle", "id": check.id})  # the child does so itself on a cost
        else:
            self._send({"op": "kill", "id": check.id})
            self.num_demoted += 1
            slow.push(check)

    def _kill(self, check: _Check) -> None:
        """Kill the check's run (its frames are ignored from now on)."""
        self._lanes[check.lane].running.pop(check.id, None)
        self._send({"op": "kill", "id": check.id})

    def _expire(self, check: _Check) -> None:
        if check.future.done():
            return
        if check.id in self._lanes[check.lane].running:
            self._kill(check)
            self.num_killed += 1
        self._finish(check, (str(GrammarTimeoutError(
            f"{check.where} was not checked within grammar_compile_timeout "
            f"({self.timeout_s:g} s); send a smaller or simpler constraint (or raise the "
            "server's --grammar-compile-timeout)."
        )), "timeout"))  # fmt: skip
        self._pump()

    def _finish(self, check: _Check, error: tuple[str, str] | None, cache: bool = True) -> None:
        if check.timer is not None:
            check.timer.cancel()
        self._inflight.pop(check.key, None)
        left = self._per_client.get(check.client, 1) - 1
        if left > 0:
            self._per_client[check.client] = left
        else:
            self._per_client.pop(check.client, None)
        cost = None if check.cost == float("inf") else check.cost
        if cache and (error is None or error[1] != "closed"):
            self._results[check.key] = cost if error is None else error
            while len(self._results) > CACHE_ENTRIES:
                self._results.popitem(last=False)
        if not check.future.done():
            if error is None:
                check.future.set_result(cost)
            else:
                check.future.set_exception(_exception(error))


def _exception(error: tuple[str, str]) -> BaseException:
    message, reason = error
    if reason == "timeout":
        return GrammarTimeoutError(message)
    if reason == "closed":
        return GrammarCheckerUnavailableError(message)
    return GrammarError(message)


def _outcome(result: tuple[str, str] | float | None) -> float | None:
    """A cached result: the cost it passed with, or its error raised."""
    if isinstance(result, tuple):
        raise _exception(result)
    return result

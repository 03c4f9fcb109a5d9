"""EngineProcess: the engine thread in a child process, behind EngineThread's interface.

    server process                                   engine process (python -c ...)
    AsyncLLM ──add / abort / abort_all_at / stop──►  command pipe ──► main thread: hands each
        │      writer thread: pickles, sends               command to EngineThread
        ▲                                             EngineThread: step, step, ... ──┐
        │ emit / reject / on_dead                     EngineBeat: ("beat",) each 1 s ─┤
    reader thread ◄──────────────── outbox pipe ◄── ("step", outputs, stats, applied) ┘

The messages on both pipes, and how outputs are packed for them, are in entrypoints/wire.py;
the child's side is engine_child.py.

Nothing a request carries can break the transport: each command is pickled on its own, and
one that does not pickle fails its request only (`reject`; a constraint crosses as its JSON
text, so a deep schema does not even recurse). Any other failure of the writer or the reader
thread ends the engine loudly: it is logged, the child is killed, and `on_dead` reports it,
so the supervisor rules apply (a single engine's server exits 1, a replica is restarted).

Liveness: the child beats every second, whatever its step does. With `heartbeat_timeout_s`
set, a child that sends nothing for that long (stopped, dead-locked) is killed and reported
dead like one that died. This is not the progress watchdog (heartbeat.py): a long step still
beats, and a live engine that makes no step with work in flight is hung, not killed.

Why a process: the HTTP side (parsing, SSE encoding, socket writes) and the engine's Python
between torch ops share one GIL in one process. Every burst of streaming work after a step then
stalls the engine until the burst ends, which the same load in another process does about
half as much (docs/kernels.md#measured-choices). vLLM runs its engine core in its own process
for the same reason.

The child ignores SIGINT and SIGTERM: the server process decides when it stops (a terminal's
Ctrl-C or systemd's SIGTERM reach the whole process group, and the engine must keep serving
through the graceful drain). It exits after a "stop" command, or when its command pipe
closes because the server process is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from conveyor.config import EngineConfig
from conveyor.core.limits import PromptLimits
from conveyor.engine.outputs import RequestOutput
from conveyor.entrypoints.engine_client import StepStats
from conveyor.entrypoints.wire import EngineProcessError, unpack_output
from conveyor.model.loading.pooling_config import PoolingConfig
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine resolved at startup, for callers that have no engine at hand."""

    model_path: str
    limits: PromptLimits
    num_kv_blocks: int
    pooling: PoolingConfig | None = None  # how embedding requests pool (None: unknown)


class EngineProcess:
    """Start an engine process and wait until its engine is built.

    Args:
        config: the engine's settings (num_kv_blocks and max_model_len are filled in with
            what the engine resolved, as LLMEngine does).
        emit, reject, on_dead: as for EngineThread; called in this process's reader thread.
        startup_timeout_s: how long building the engine may take.
        env: extra environment variables for the child (a data-parallel replica's
            CUDA_VISIBLE_DEVICES).
        cpu_cores: pin the child to these CPU cores, with as many torch threads (None: not
            pinned, torch's default threads).
        heartbeat_timeout_s: once started, a child that sends nothing (not even its beat)
            for this long is killed and reported to `on_dead` (None: never).
    Raises:
        ValueError: the engine rejected the config or the checkpoint (the child's error).
        EngineProcessError: the child died or timed out while starting.
    """

    def __init__(
        self,
        config: EngineConfig,
        emit: Callable[[list[RequestOutput], StepStats], None],
        reject: Callable[[str, ValueError], None],
        on_dead: Callable[[BaseException], None],
        startup_timeout_s: float = 900.0,
        env: dict[str, str] | None = None,
        cpu_cores: tuple[int, ...] | None = None,
        heartbeat_timeout_s: float | None = None,
    ) -> None:
        self._emit, self._reject, self._on_dead = emit, reject, on_dead
        self.heartbeat_timeout_s = heartbeat_timeout_s or None
        self._dead_lock = threading.Lock()
        self._reported_dead = False
        self._stopping = False
        # A fresh interpreter, not multiprocessing's spawn: that re-imports the caller's
        # __main__, which breaks scripts without an `if __name__ == "__main__"` guard.
        command_fd, self_commands_fd = os.pipe()
        self_outbox_fd, outbox_fd = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-c", _CHILD_MAIN, str(command_fd), str(outbox_fd)],
            pass_fds=(command_fd, outbox_fd),
            env={**os.environ, **env} if env else None,
        )
        # Operators (and tests) need the engine's pid to watch it: it is not the server's.
        logger.info("Engine process started (pid %d)", self._process.pid)
        os.close(command_fd)
        os.close(outbox_fd)
        self._commands = Connection(self_commands_fd, readable=False)
        self._outbox = Connection(self_outbox_fd, writable=False)
        level = logging.getLogger("conveyor").getEffectiveLevel()
        self._commands.send((config, level, cpu_cores))
        # Commands go out through a writer thread: a pipe the engine does not read (it is
        # stopped or hung) fills up, and a blocked send must not block the event loop.
        self._outgoing: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._queued_seqs = 0
        self._applied_seqs = 0
        self._unsent_seqs = 0  # added, but their add failed to pickle (the writer's count)
        self.last_stats: StepStats | None = None  # the engine's latest report
        try:
            self.info = self._wait_until_ready(startup_timeout_s)
        except BaseException:
            self._kill()
            raise
        config.num_kv_blocks = self.info.num_kv_blocks
        config.max_model_len = self.info.limits.max_model_len
        self._reader = threading.Thread(
            target=self._read, name="conveyor-engine-reader", daemon=True
        )
        self._writer = threading.Thread(
            target=self._write, name="conveyor-engine-writer", daemon=True
        )
        self._writer.start()

    def _wait_until_ready(self, timeout_s: float) -> EngineInfo:
        if not self._outbox.poll(timeout_s):
            raise EngineProcessError(f"The engine process did not start within {timeout_s} s.")
        try:
            kind, payload = self._outbox.recv()
        except EOFError:
            raise EngineProcessError(
                f"The engine process exited while starting (exit code {self._exit_code(5)})."
            ) from None
        if kind == "failed":
            raise payload
        return payload

    # ---------------------------------------------------------------- EngineThread's API
    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def started(self) -> bool:
        return self._reader.ident is not None

    @property
    def alive(self) -> bool:
        return self._reader.is_alive() and self._process.poll() is None

    @property
    def num_queued_seqs(self) -> int:
        """Sequences added but not yet handed to the engine (as of its latest report)."""
        return self._queued_seqs - self._applied_seqs - self._unsent_seqs

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences not yet running: queued plus the scheduler's waiting ones (as of the
        engine's latest report)."""
        waiting = self.last_stats.num_waiting if self.last_stats is not None else 0
        return waiting + self.num_queued_seqs

    def start(self) -> None:
        """Start handing the engine's reports to the callbacks."""
        self._reader.start()

    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        self._queued_seqs += params.n
        # The engine gets the ids only: the prompt text stays here (AsyncLLM has it).
        self._send(("add", request_id, prompt_ids, prompt_ids, params, arrival_time))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def abort_all_at(self, when: float, reason: str) -> None:
        self._send(("abort_all_at", when, reason))

    def stop(self, final_reason: str | None = None, timeout_s: float | None = None) -> None:
        """Blocking: the engine aborts what is left with `final_reason`, reports it, and the
        process exits; it is killed if it has not after `timeout_s` (None: 60 s) plus up to
        30 s more."""
        timeout_s = 60.0 if timeout_s is None else timeout_s
        self._stopping = True
        self._send(("stop", final_reason))
        if self.started:
            self._reader.join(timeout_s)
        self._exit_code(min(30.0, timeout_s))
        self._outgoing.put(None)
        self._kill()

    # ---------------------------------------------------------------- internals
    def _send(self, command: tuple[Any, ...]) -> None:
        self._outgoing.put(command)

    def _write(self) -> None:
        """Send queued commands in order until stop() ends the queue or the child is gone."""
        try:
            while (command := self._outgoing.get()) is not None:
                try:
                    data = pickle.dumps(command, pickle.HIGHEST_PROTOCOL)
                except Exception as exc:  # whatever the request carries
                    if command[0] != "add":
                        raise
                    self._unsent_seqs += command[4].n
                    self._reject(command[1], _unsendable(exc))
                    continue
                try:
                    self._commands.send_bytes(data)
                except OSError:  # a dead child: the reader tells
                    return
        except BaseException as exc:
            self._fail("writer", exc)

    def _read(self) -> None:
        """Hand the engine's reports to the callbacks until it stops or dies."""
        try:
            self._read_reports()
        except BaseException as exc:
            self._fail("reader", exc)

    def _read_reports(self) -> None:
        outbox, timeout_s = self._outbox, self.heartbeat_timeout_s
        while True:
            if timeout_s is not None and not outbox.poll(timeout_s):
                self._kill()
                if not self._stopping:
                    self._report_dead(
                        EngineProcessError(
                            f"The engine process (pid {self.pid}) sent nothing for "
                            f"{timeout_s:g} s, not even its heartbeat "
                            "(engine_heartbeat_timeout): it was stopped or dead-locked, and "
                            "has been killed."
                        )
                    )
                return
            try:
                message = outbox.recv()
            except (EOFError, OSError):
                code = self._exit_code(5)
                died = EngineProcessError(f"The engine process died (exit code {code}).")
                self._report_dead(died)
                return
            kind = message[0]
            if kind == "step":
                _, packed, packed_stats, applied = message
                stats = StepStats(*packed_stats)
                self._applied_seqs, self.last_stats = applied, stats
                self._emit([unpack_output(p) for p in packed], stats)
            elif kind == "reject":
                self._reject(message[1], message[2])
            elif kind == "dead":
                self._report_dead(EngineProcessError(message[1]))
            elif kind == "stopped":
                return

    def _report_dead(self, exc: BaseException) -> None:
        """`on_dead(exc)`, once: the writer and the reader may both see the end."""
        with self._dead_lock:
            first, self._reported_dead = not self._reported_dead, True
        if first:
            self._on_dead(exc)

    def _fail(self, thread: str, exc: BaseException) -> None:
        """The writer or reader thread failed: the transport is gone, so is the engine."""
        logger.error(
            "The engine process's %s thread failed; killing the engine process (pid %d)",
            thread, self.pid, exc_info=exc,
        )  # fmt: skip
        # Reported before the kill, so that the reader's "it died" does not hide the cause.
        self._report_dead(
            EngineProcessError(f"The engine transport's {thread} thread failed: {exc!r}")
        )
        self._kill()

    def _exit_code(self, timeout_s: float) -> int | None:
        """Wait up to `timeout_s` for the process to end; its exit code, None if it runs."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout_s)
        return self._process.returncode

    def _kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


# The child's code is in engine_child.py.
_CHILD_MAIN = "import sys; from conveyor.entrypoints.engine_child import main; main(sys.argv[1:])"


def _unsendable(exc: Exception) -> ValueError:
    return ValueError(
        f"The request cannot be sent to the engine process ({type(exc).__name__}: {exc})."
    )

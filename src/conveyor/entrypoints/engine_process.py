"""EngineProcess: the engine thread in a child process, behind EngineThread's interface.

    server process                                   engine process (python -c ...)
    AsyncLLM ──add / abort / abort_all_at / stop──►  command pipe ──► main thread: hands each
        ▲                                                              command to EngineThread
        │ emit / reject / on_dead                     EngineThread: step, step, ... ──┐
    reader thread ◄──────────────── outbox pipe ◄── ("step", outputs, stats, applied) ┘

The messages on both pipes, and how outputs are packed for them, are in entrypoints/wire.py.

Why a process: the HTTP side (parsing, SSE encoding, socket writes) and the engine's Python
between torch ops share one GIL in one process. Every burst of streaming work after a step then
stalls the engine until the burst ends; measured on 2 cores, a thread using a fifth of a core
slows LLM.generate by 20-25%, the same load in another process by about 12%. vLLM runs its
engine core in its own process for the same reason.

The child ignores SIGINT and SIGTERM: the server process decides when it stops (a terminal's
Ctrl-C or systemd's SIGTERM reach the whole process group, and the engine must keep serving
through the graceful drain). It exits after a "stop" command, or when its command pipe
closes because the server process is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from conveyor.core.limits import PromptLimits
from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.entrypoints.engine_client import StepStats
from conveyor.entrypoints.engine_thread import EngineThread
from conveyor.entrypoints.wire import EngineProcessError, pack_output, picklable, unpack_output
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine resolved at startup, for callers that have no engine at hand."""

    model_path: str
    limits: PromptLimits
    num_kv_blocks: int


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
    ) -> None:
        self._emit, self._reject, self._on_dead = emit, reject, on_dead
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
        return self._queued_seqs - self._applied_seqs

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
        while (command := self._outgoing.get()) is not None:
            try:
                self._commands.send(command)
            except OSError:  # a dead child: the reader tells
                return

    def _read(self) -> None:
        """Hand the engine's reports to the callbacks until it stops or dies."""
        outbox = self._outbox
        while True:
            try:
                message = outbox.recv()
            except (EOFError, OSError):
                code = self._exit_code(5)
                self._on_dead(EngineProcessError(f"The engine process died (exit code {code})."))
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
                self._on_dead(EngineProcessError(message[1]))
            elif kind == "stopped":
                return

    def _exit_code(self, timeout_s: float) -> int | None:
        """Wait up to `timeout_s` for the process to end; its exit code, None if it runs."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout_s)
        return self._process.returncode

    def _kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


# -------------------------------------------------------------------- the child
_CHILD_MAIN = "import sys; from conveyor.entrypoints.engine_process import main; main(sys.argv[1:])"


def main(argv: list[str]) -> None:
    """The engine process's entry: argv holds the command and outbox pipe descriptors."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    commands = Connection(int(argv[0]), writable=False)
    outbox = Connection(int(argv[1]), readable=False)
    try:
        config, log_level, cpu_cores = commands.recv()
    except EOFError:
        return
    if cpu_cores:  # before the first torch op starts its thread pool
        import torch

        os.sched_setaffinity(0, cpu_cores)
        torch.set_num_threads(len(cpu_cores))
    logging.basicConfig(
        level=log_level,
        format="%(levelname)s %(asctime)s %(name)s [engine]: %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    run_engine_process(config, commands, outbox)


def run_engine_process(config: EngineConfig, commands: Connection, outbox: Connection) -> None:
    """Build the engine, report it ready, serve commands until "stop" or the pipe closes."""
    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock, contextlib.suppress(OSError):  # the server is gone: nobody listens
            outbox.send(message)

    try:
        engine = LLMEngine(config)
    except Exception as exc:
        send(("failed", picklable(exc)))
        return
    info = EngineInfo(engine.model_path, engine.limits, engine.config.num_kv_blocks)
    send(("ready", info))

    def emit(outputs: list[RequestOutput], stats: StepStats) -> None:
        packed_stats = dataclasses.astuple(stats)
        send(("step", [pack_output(out) for out in outputs], packed_stats, thread.applied_seqs))

    thread = EngineThread(
        engine,
        emit=emit,
        reject=lambda request_id, exc: send(("reject", request_id, exc)),
        on_dead=lambda exc: send(("dead", f"The engine failed and stopped: {exc!r}")),
    )
    thread.start()
    while True:
        try:
            command = commands.recv()
        except (EOFError, OSError):  # the server process is gone
            command = ("stop", "the server process exited")
        kind = command[0]
        if kind == "add":
            thread.add(*command[1:])
        elif kind == "abort":
            thread.abort(command[1])
        elif kind == "abort_all_at":
            thread.abort_all_at(command[1], command[2])
        elif kind == "stop":
            thread.stop(command[1])
            break
    send(("stopped",))

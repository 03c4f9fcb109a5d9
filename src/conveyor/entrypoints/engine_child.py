"""The engine process's side of EngineProcess (engine_process.py): its entry point, the
command loop and the liveness beat.

    main thread:     builds the engine, then step, step, ... ──► ("step", ...) on the outbox
                     (EngineThread.run: the thread that built the engine steps it)
    commands thread: commands pipe ──► EngineThread.add / abort / abort_all_at / stop
    beat thread:     ("beat",) on the outbox every BEAT_INTERVAL_S, whatever the step does

The beat proves the process is alive, not that it makes progress: it goes on through a long
step (torch ops and the C kernels release the GIL), and stops when the process is stopped
(SIGSTOP), dead-locked or gone, which the server notices within its engine_heartbeat_timeout.
Progress is the server's other watchdog (heartbeat.py: work in flight and no step).

The process ignores SIGINT and SIGTERM: the server process decides when it stops. A command
that cannot be read (the transport is broken) ends the engine loudly: a "dead" report, then
the usual stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from conveyor.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.entrypoints.engine_client import StepStats
from conveyor.entrypoints.engine_process import EngineInfo
from conveyor.entrypoints.engine_thread import EngineThread
from conveyor.entrypoints.wire import pack_output, picklable
from conveyor.heap import release_freed_memory

logger = logging.getLogger(__name__)

BEAT_INTERVAL_S = 1.0


class EngineBeat:
    """A daemon thread that calls `send(("beat",))` every `interval_s` until `stop()`."""

    def __init__(self, send: Any, interval_s: float = BEAT_INTERVAL_S) -> None:
        self._send, self._interval_s = send, interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-engine-beat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self._send(("beat",))


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
    # Out at once: a grammar compile still running in its thread (xgrammar cannot be stopped)
    # would hold a normal exit, which waits for every non-daemon thread, for its whole length.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


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
    info = EngineInfo(engine.model_path, engine.limits, engine.config.num_kv_blocks, engine.pooling)
    release_freed_memory()  # what loading freed (the checkpoint's conversions) leaves the heap
    send(("ready", info))
    beat = EngineBeat(send)
    beat.start()

    def emit(outputs: list[RequestOutput], stats: StepStats) -> None:
        packed_stats = dataclasses.astuple(stats)
        send(("step", [pack_output(out) for out in outputs], packed_stats, thread.applied_seqs))

    thread = EngineThread(
        engine,
        emit=emit,
        reject=lambda request_id, exc: send(("reject", request_id, exc)),
        on_dead=lambda exc: send(("dead", f"The engine failed and stopped: {exc!r}")),
    )
    reader = threading.Thread(
        target=_read_commands, args=(commands, thread, send), name="conveyor-commands",
        daemon=True,
    )  # fmt: skip
    reader.start()
    # The steps run in this thread, the one that built the engine (EngineThread's docstring
    # says why: a second thread stepping it makes every OpenMP region pay a wake-up).
    thread.run()
    reader.join()  # after the engine's death too: until the server says stop (or is gone)
    beat.stop()
    engine.shutdown()  # its tensor-parallel workers: the exit that follows runs no atexit
    send(("stopped",))


def _read_commands(commands: Connection, thread: EngineThread, send: Any) -> None:
    """Hand the server's commands to `thread` until "stop" (or the pipe closes)."""
    while True:
        try:
            command = commands.recv()
        except (EOFError, OSError):  # the server process is gone
            command = ("stop", "the server process exited")
        except Exception as exc:  # a command that does not unpickle
            command = _broken(send, exc)
        kind = command[0]
        try:
            if kind == "add":
                thread.add(*command[1:])
            elif kind == "abort":
                thread.abort(command[1])
            elif kind == "abort_all_at":
                thread.abort_all_at(command[1], command[2])
            elif kind == "stop":
                thread.stop(command[1])
                return
        except Exception as exc:  # a command this loop cannot apply
            thread.stop(_broken(send, exc)[1])
            return


def _broken(send: Any, exc: Exception) -> tuple[str, str]:
    """The transport failed: log it, report the engine dead; the stop command to apply."""
    logger.error("The engine process cannot go on reading commands", exc_info=exc)
    send(("dead", f"The engine process failed reading its commands: {exc!r}"))
    return ("stop", "the engine process failed")

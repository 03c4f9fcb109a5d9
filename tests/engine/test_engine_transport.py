"""The engine process's transport (issue 27, items 1 and 7), against real engine processes.

Nothing a request carries breaks it: an add that cannot be pickled fails that request only.
A failure of the server side's writer or reader thread ends the engine loudly (killed, logged,
`on_dead`), never a server that looks healthy and serves nothing. Liveness is the beat the
engine process sends every second: stopped (SIGSTOP), it is noticed within
heartbeat_timeout_s and killed; a step far longer than that timeout still beats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import signal
import subprocess
import time

import pytest
from tests.serve_process import slow_step_env

from conveyor import AsyncLLM, SamplingParams
from conveyor.config import EngineConfig
from conveyor.entrypoints.engine_process import EngineProcess

pytestmark = pytest.mark.slow  # real engine processes, long steps

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 60  # generous bounds: the machine may be loaded


class _Reports:
    """What an EngineProcess reports, as queues the test can wait on."""

    def __init__(self) -> None:
        self.steps: queue.SimpleQueue = queue.SimpleQueue()
        self.rejected: queue.SimpleQueue = queue.SimpleQueue()
        self.dead: queue.SimpleQueue = queue.SimpleQueue()

    def emit(self, outputs, stats) -> None:
        self.steps.put((outputs, stats))

    def reject(self, request_id, exc) -> None:
        self.rejected.put((request_id, exc))

    def on_dead(self, exc) -> None:
        self.dead.put(exc)


def _start(demo_model_dir, reports: _Reports, **kwargs) -> EngineProcess:
    config = EngineConfig(model=str(demo_model_dir), num_kv_blocks=64)
    process = EngineProcess(config, reports.emit, reports.reject, reports.on_dead, **kwargs)
    process.start()
    return process


def _gone(process: EngineProcess, timeout_s: float = TIMEOUT_S) -> bool:
    """The engine process has ended (waiting up to `timeout_s` for it)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process._process.wait(timeout_s)
    return process._process.poll() is not None


def test_an_add_that_cannot_be_pickled_fails_alone_and_the_engine_serves_on(
    demo_model_dir,
) -> None:
    """Before: the writer thread died of the pickling error, and no later command ever
    reached the engine (every request hung, /health said 200)."""

    class Unpicklable(SamplingParams):  # a local class: pickle cannot name it
        pass

    async def run() -> None:
        llm = AsyncLLM(
            str(demo_model_dir), num_kv_blocks=64, log_stats_interval_s=0, engine_process=True
        )
        try:
            bad = Unpicklable(max_tokens=4, n=2)
            with pytest.raises(ValueError, match="cannot be sent to the engine process"):
                async for _ in llm.generate("bad", bad):
                    pass
            outs = [o async for o in llm.generate("good", GREEDY)]
            assert sum(len(o.outputs[0].token_ids) for o in outs) == 4
            assert outs[-1].finished and llm.num_waiting_seqs == 0
            llm.check_health()
        finally:
            await llm.shutdown()

    asyncio.run(asyncio.wait_for(run(), TIMEOUT_S * 3))


def test_a_failed_reader_thread_kills_the_engine_and_reports_it_dead(
    demo_model_dir, caplog
) -> None:
    """Before: the reader thread died alone; the engine ran on unheard and nobody was told."""
    reports = _Reports()

    def broken_emit(outputs, stats) -> None:
        raise RuntimeError("a callback that fails")

    reports.emit = broken_emit  # type: ignore[method-assign]
    process = _start(demo_model_dir, reports)
    try:
        with caplog.at_level(logging.ERROR, logger="conveyor.entrypoints.engine_process"):
            process.add("r", [1, 2, 3], [1, 2, 3], GREEDY, time.monotonic())
            dead = reports.dead.get(timeout=TIMEOUT_S)
        assert "reader thread failed" in str(dead) and "a callback that fails" in str(dead)
        assert _gone(process) and not process.alive
        assert "reader thread failed; killing the engine process" in caplog.text
        assert reports.dead.empty()  # reported once, not again when its pipe closed
    finally:
        process.stop(timeout_s=5)


def test_a_failed_writer_thread_kills_the_engine_and_reports_it_dead(demo_model_dir) -> None:
    """Before: the writer thread died alone; later commands queued up for nobody."""
    reports = _Reports()
    process = _start(demo_model_dir, reports)
    try:
        process.abort_all_at(time.monotonic() + 60, lambda: "a reason that is no string")
        dead = reports.dead.get(timeout=TIMEOUT_S)
        assert "writer thread failed" in str(dead)
        assert _gone(process) and not process.alive
    finally:
        process.stop(timeout_s=5)


def test_a_stopped_engine_process_misses_its_heartbeat_and_is_killed(demo_model_dir) -> None:
    """Before: a stopped engine process was never noticed while it held no request."""
    reports = _Reports()
    process = _start(demo_model_dir, reports, heartbeat_timeout_s=2.0)
    try:
        time.sleep(0.5)  # no request at all: only the beat says it is alive
        os.kill(process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        dead = reports.dead.get(timeout=TIMEOUT_S)
        # Silence counts from the last beat, up to a beat interval (1 s) before the stop.
        assert time.monotonic() - stopped >= 1.0
        assert "sent nothing for 2 s, not even its heartbeat" in str(dead), dead
        assert _gone(process)  # killed: SIGKILL ends a stopped process too
    finally:
        if not _gone(process, 0):
            os.kill(process.pid, signal.SIGCONT)
        process.stop(timeout_s=5)


def test_a_step_far_longer_than_the_heartbeat_timeout_is_not_called_hung(
    demo_model_dir, tmp_path
) -> None:
    reports = _Reports()
    # 3 s: a beat thread waits that long for a core only on a very busy machine
    env = slow_step_env(tmp_path, 9.0)
    process = _start(demo_model_dir, reports, heartbeat_timeout_s=3.0, env=env)
    try:
        process.add("r", [1, 2, 3], [1, 2, 3], SamplingParams(max_tokens=1), time.monotonic())
        longest, finished = 0.0, False
        while not finished:
            outputs, stats = reports.steps.get(timeout=TIMEOUT_S)
            longest = max(longest, stats.step_time_s)
            finished = any(out.finished for out in outputs)
        assert longest >= 9.0  # the step ran 3 heartbeat timeouts
        assert reports.dead.empty() and process.alive
    finally:
        process.stop(timeout_s=30)
    assert reports.dead.empty()

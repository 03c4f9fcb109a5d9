"""Signals to the real engine process of a real `conveyor serve` (issue 14, items 6 and 7;
issue 27, item 7).

Progress: a stopped engine (SIGSTOP) is hung: once it has had work and made no step for
--engine-stall-timeout seconds, /health answers 503 and the in-flight stream ends with an
error event; continued (SIGCONT), it serves again. Liveness: an engine process that sends
nothing, not even its beat, for --engine-heartbeat-timeout seconds (stopped, with or without
work) is killed, and the server exits 1; a step far longer than that timeout still beats. A
killed engine (SIGKILL): the stream ends with an error event, and the server exits on its own
with status 1 so a supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from tests.serve_process import slow_step_env, start_server

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

STALL_S = 2.0
LONG = {"prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def _engine_pid(server) -> int:
    """The engine child's pid, from the line the server logs for operators."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = re.search(r"Engine process started \(pid (\d+)\)", server.log())
        if found:
            pid = int(found.group(1))
            with open(f"/proc/{pid}/stat") as f:  # a child of the server process
                assert int(f.read().split(") ", 1)[1].split()[1]) == server.proc.pid
            return pid
        time.sleep(0.1)
    raise AssertionError(f"no engine pid in the log:\n{server.log()}")


def _events(lines: Iterator[str]) -> Iterator[str]:
    return (line for line in lines if line)


def _wait_status(url: str, status: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health", timeout=5).status_code != status:
        assert time.monotonic() < deadline, f"/health never answered {status}"
        time.sleep(0.1)


def test_a_stopped_engine_is_reported_hung_and_its_streams_end(demo_model_dir, tmp_path) -> None:
    args = ["--model", str(demo_model_dir), "--num-kv-blocks", "300"]
    # Progress only: the liveness check would kill the stopped engine, given time.
    args += ["--engine-heartbeat-timeout", "120"]
    server = start_server([*args, "--engine-stall-timeout", str(STALL_S)], tmp_path)
    url = server.base_url
    pid = _engine_pid(server)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as resp:
            events = _events(resp.iter_lines())
            assert next(events).startswith("data: {")  # generating
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            rest = list(events)
        waited = time.monotonic() - stopped
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "hung" in error["message"], error
        # Not before the stall timeout; no upper bound: the "hung" error event shows that the
        # watchdog ended the stream (the client's 60 s read timeout would raise instead).
        assert waited > STALL_S - 0.5, waited
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "hung" in health.json()["error"]["message"]
        assert httpx.head(f"{url}/health").status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert refused.status_code == 503 and "hung" in refused.json()["error"]["message"]
        os.kill(pid, signal.SIGCONT)  # it was only stopped: it steps again, and is healthy
        _wait_status(url, 200)
        again = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
        assert server.stop() == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # never leave a stopped orphan behind
        server.stop(signal.SIGKILL)
    log = server.log()
    assert "it is hung" in log and "The engine steps again" in log
    assert "Traceback" not in log


def test_a_killed_engine_ends_streams_and_the_server_exits_1(demo_model_dir, tmp_path) -> None:
    server = start_server(["--model", str(demo_model_dir), "--num-kv-blocks", "300"], tmp_path)
    url = server.base_url
    pid = _engine_pid(server)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as resp:
            events = _events(resp.iter_lines())
            assert next(events).startswith("data: {")
            os.kill(pid, signal.SIGKILL)
            rest = list(events)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "engine process died" in error["message"], error
        assert server.proc.wait(timeout=30) == 1  # no zombie server: a supervisor restarts it
    finally:
        server.stop(signal.SIGKILL)
    log = server.log()
    assert "The engine died; stopping the server with exit status 1" in log


HEARTBEAT_S = 2.0


def test_a_stopped_idle_engine_misses_its_heartbeat_and_the_server_exits_1(
    demo_model_dir, tmp_path
) -> None:
    """Before: with no request in flight nothing noticed; /health said 200 for as long as the
    engine stayed stopped (and the stall timeout, 120 s by default, needs work in flight)."""
    args = ["--model", str(demo_model_dir), "--num-kv-blocks", "64"]
    server = start_server([*args, "--engine-heartbeat-timeout", str(HEARTBEAT_S)], tmp_path)
    url = server.base_url
    pid = _engine_pid(server)
    try:
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while (health := _health_or_none(url)) is not None and health.status_code == 200:
            assert time.monotonic() - stopped < 30, "/health stayed 200"
            time.sleep(0.1)
        if health is not None:  # else the server has exited already
            assert health.status_code == 503, health.text
            assert "not even its heartbeat" in health.json()["error"]["message"]
        assert server.proc.wait(timeout=30) == 1  # for its supervisor to restart
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        server.stop(signal.SIGKILL)
    log = server.log()
    assert "sent nothing for 2 s, not even its heartbeat" in log
    assert "The engine died; stopping the server with exit status 1" in log


def _health_or_none(url: str) -> httpx.Response | None:
    """GET /health; None once the server no longer listens."""
    try:
        return httpx.get(f"{url}/health", timeout=5)
    except httpx.ConnectError:
        return None


def test_a_step_far_longer_than_the_heartbeat_timeout_is_not_hung(demo_model_dir, tmp_path) -> None:
    args = ["--model", str(demo_model_dir), "--num-kv-blocks", "64"]
    args += ["--engine-heartbeat-timeout", "3"]  # a beat waits that long only on a busy machine
    server = start_server(args, tmp_path, env=slow_step_env(tmp_path, 9.0))
    url = server.base_url
    try:
        with httpx.Client(timeout=120) as http:
            started = time.monotonic()
            body = {"prompt": "x", "max_tokens": 1, "ignore_eos": True}
            resp = http.post(f"{url}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 1
            assert time.monotonic() - started >= 9.0  # one step of 3 heartbeat timeouts
            assert http.get(f"{url}/health").status_code == 200
        assert server.stop() == 0
    finally:
        server.stop(signal.SIGKILL)
    assert "heartbeat" not in server.log()

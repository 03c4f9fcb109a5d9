"""Signals to the real engine process of a real `conveyor serve` (issue 14, items 6 and 7).

A stopped engine (SIGSTOP) is hung: once it has had work and made no step for
--engine-stall-timeout seconds, /health answers 503 and the in-flight stream ends with an
error event; continued (SIGCONT), it serves again. A killed engine (SIGKILL): the stream ends
with an error event, and the server exits on its own with status 1 so a supervisor restarts it.
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
from tests.serve_process import start_server

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
        assert STALL_S - 0.5 < waited < STALL_S + 5, waited
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

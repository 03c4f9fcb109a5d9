"""SIGTERM on a real `conveyor serve`: new requests get 503, in-flight ones finish within the
grace period, the rest end cleanly with finish_reason "abort", and the process exits 0; a
client still sending its request cannot hold the exit up; plus the Dockerfile's health check."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tests.serve_process import (
    answer_to_sigterm,
    held_render_env,
    metric_value,
    slow_step_env,
    start_server,
)

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def _stream_events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        return [line for line in r.iter_lines() if line]


def test_sigterm_drains_then_aborts_and_exits(demo_model_dir, tmp_path) -> None:
    server = start_server(
        ["--model", str(demo_model_dir), "--num-kv-blocks", "256", "--shutdown-timeout", "1"],
        tmp_path,
    )
    url = server.base_url
    try:
        # The Dockerfile's HEALTHCHECK command, pointed at this server's port.
        check = re.search(r"HEALTHCHECK .*\n\s+CMD (\[.*\])", DOCKERFILE.read_text())
        command = json.loads(check.group(1))
        command[-1] = command[-1].replace(":8000/", f":{server.port}/")
        assert subprocess.run([sys.executable, *command[1:]], timeout=30).returncode == 0

        # The demo model makes 2000 tokens in about 2 s on a quiet machine (1 ms a token), so
        # the long stream outlasts the 1 s grace period and the short one ends well inside it.
        long_body = {"prompt": "long", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        short_body = {"prompt": "short", "max_tokens": 20, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(_stream_events, url, long_body)
            short = pool.submit(httpx.post, f"{url}/v1/completions", json=short_body, timeout=60)
            deadline = time.monotonic() + 30
            while not short.done():  # wait until both are running, then stop the server
                text = httpx.get(f"{url}/metrics").text
                if metric_value(text, "conveyor:num_requests_running") == 2:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.02)
            sent = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            # Draining: still listening, but /health and new requests get 503.
            while httpx.get(f"{url}/health").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=5)
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "ServiceUnavailableError"
            short_resp = short.result()
            events = long.result()
        # In flight before SIGTERM: finished normally.
        assert short_resp.status_code == 200
        assert short_resp.json()["choices"][0]["finish_reason"] == "length"
        assert short_resp.json()["usage"]["completion_tokens"] == 20
        # Still running when the grace period ended: aborted, and the stream ended cleanly.
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "abort"
        assert time.monotonic() - sent >= 0.8
        assert "server shutting down" in last["choices"][0]["stop_reason"]
        assert server.proc.wait(timeout=30) == 0  # a drained server exits cleanly
    finally:
        server.stop(signal.SIGKILL)
    log = server.log()
    assert "Shutting down: no new requests" in log
    assert "aborting 1 requests" in log
    assert "Traceback" not in log


def test_a_client_still_sending_its_request_does_not_hold_up_the_exit(
    demo_model_dir, tmp_path
) -> None:
    """A request whose body still trickles in has not reached the engine: at shutdown it gets
    503 and its connection closes, so the process exits while the client is still sending,
    not once the body is complete (nor at uvicorn's backstop, the grace period + 5 s)."""
    args = ["--model", str(demo_model_dir), "--num-kv-blocks", "64"]
    args += ["--shutdown-timeout", "60", "--body-timeout", "120"]  # neither ends it first
    server = start_server(args, tmp_path)
    try:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n{"
        )
        sock.settimeout(0.25)
        answer, sent, stopped, closed = b"", 0, None, False
        # A byte every 0.25 s, far from the 1000 announced, until the server closes the
        # connection: given 30 s after SIGTERM (generous for a loaded machine), half the 60 s
        # grace period that an exit held up by the body would wait for.
        while stopped is None or time.monotonic() - stopped < 30:
            if sent == 4 and stopped is None:  # the head is in by now: stop the server
                server.proc.send_signal(signal.SIGTERM)
                stopped = time.monotonic()
            try:
                sock.sendall(b" ")
                sent += 1
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            answer += chunk
        sock.close()
        assert closed, "the server waited for the whole body before it closed the connection"
        assert server.proc.wait(timeout=30) == 0
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:100]
        assert b"shutting down" in answer
    finally:
        server.stop(signal.SIGKILL)
    assert "Traceback" not in server.log()


def test_a_request_cut_by_the_shutdown_backstop_gets_503(demo_model_dir, tmp_path) -> None:
    """uvicorn cancels what still runs its graceful-shutdown timeout (the grace period + 5 s)
    after SIGTERM; before, it answered such a request with a bare 500 and logged a traceback.
    One cut before its response started gets the 503 error body every request refused at
    shutdown gets. Its chat template render is held here (never ends): only the backstop
    ends it."""
    args = ["--model", str(demo_model_dir), "--num-kv-blocks", "64", "--shutdown-timeout", "1"]
    server = start_server(args, tmp_path, env=held_render_env(tmp_path))
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        held = lambda: "a chat template render is held" in server.log()  # noqa: E731
        r = answer_to_sigterm(server, "/v1/chat/completions", body, held)
    finally:
        server.stop(signal.SIGKILL)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert error["message"] == "The server is shutting down."
    log = server.log()
    assert "timeout graceful shutdown exceeded" in log  # the backstop, not the render, ended it
    assert "Traceback" not in log


@pytest.mark.parametrize(
    "sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "part-of-head"]
)
def test_a_request_on_its_way_when_the_server_stops_listening_gets_503(
    demo_model_dir, tmp_path, sent
) -> None:
    """A connection the server accepted, its request not (wholly) read when the server stops
    listening: before, uvicorn closed it (a reset where the request's bytes came in after), so
    its client got no answer; now it gets 503, as one still sending its body does. A stream in
    flight keeps the draining server listening until the connection is in."""
    args = ["--model", str(demo_model_dir), "--num-kv-blocks", "64", "--shutdown-timeout", "60"]
    server = start_server(args, tmp_path, env=slow_step_env(tmp_path, 0.05))
    url = server.base_url
    try:
        body = {"prompt": "long", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            next(stream.iter_lines())  # it runs (for 50 s): the drain waits for it
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(sent)
            server.proc.send_signal(signal.SIGTERM)
            # Draining: the server took the connection above (and read what it sent) before
            # it read this later one.
            deadline = time.monotonic() + 30
            while httpx.get(f"{url}/health").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        # The stream's client left: nothing is in flight, so the server stops listening and
        # closes its connections.
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        sock.close()
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop(signal.SIGKILL)
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:100]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"] == (
        "The server is shutting down."
    )
    assert "Traceback" not in server.log()

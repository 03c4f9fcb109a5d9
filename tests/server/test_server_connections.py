"""Connections that cost the server without ever finishing a request (issue 49, item 6), against
a real `conveyor serve` over raw sockets.

Idle, slow-header and slow-body connections used to stay open forever (3,000 idle ones held
3,000 descriptors after 60 s), and a flood of them filled the open-file limit so that new
clients failed. Each is closed now (server/http_limits.py), connections are capped in all and
per client (server/connections.py), and the server process's descriptors (/proc/PID/fd) come
back to where they were. Attackers connect from other loopback addresses (127.0.0.2, ...), so
each has a per-client cap of its own while the well-behaved client stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import openai
import pytest
from tests.serve_process import start_server

from conveyor.server.connections import connection_caps

HEADER_TIMEOUT = BODY_TIMEOUT = 2.0
MAX_CONNECTIONS, PER_CLIENT = 40, 30
ARGS = [
    "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
    "--body-min-rate", "100", "--keep-alive-timeout", "2",
    "--max-connections", str(MAX_CONNECTIONS), "--max-connections-per-client", str(PER_CLIENT),
    "--num-kv-blocks", "256", "--served-model-name", "demo",
]  # fmt: skip
WAIT = 30.0  # generous: a loaded machine is slow, but a connection left open waits forever
POST_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n"
)


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    try:  # Linux routes all of 127.0.0.0/8 to loopback; elsewhere only 127.0.0.1 may exist
        with socket.socket() as probe:
            probe.bind(("127.0.0.2", 0))
    except OSError:
        pytest.skip("no second loopback address to connect from")
    proc = start_server(["--model", str(demo_model_dir), *ARGS], tmp_path_factory.mktemp("conn"))
    proc.baseline = _settled_fds(proc, 10**6)  # type: ignore[attr-defined]
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log()


def _fds(server) -> int:
    """The server process's open file descriptors."""
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def _settled_fds(server, at_most: int) -> int:
    """Wait until the server holds at most `at_most` descriptors and the count is steady."""
    deadline, last = time.monotonic() + WAIT, -1
    while time.monotonic() < deadline:
        count = _fds(server)
        if count <= at_most and count == last:
            return count
        last = count
        time.sleep(0.3)
    raise AssertionError(f"the server still holds {_fds(server)} descriptors (want <= {at_most})")


def _held(server, at_least: int) -> bool:
    """Whether the server comes to hold `at_least` descriptors (it accepts after connect())."""
    deadline = time.monotonic() + WAIT
    while _fds(server) < at_least:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _back_to_baseline(server) -> None:
    _settled_fds(server, server.baseline + 3)


def _connect(server, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", server.port))
    sock.settimeout(WAIT)
    return sock


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (socket.timeout if it never does)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _is_open(sock: socket.socket) -> bool:
    """Not closed by the server (recv would return b"" or fail)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:  # nothing to read: open
        return True
    except ConnectionError:
        return False
    finally:
        sock.settimeout(WAIT)


def _completion(server) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    return client.completions.create(model="demo", prompt="Hello", max_tokens=4)


def _slow_sender(server, source: str, head: bytes, trickle: bytes) -> tuple[bytes, bool]:
    """Send `head`, then `trickle` a byte every 0.25 s; (the answer, whether the server
    closed while bytes were still left to send)."""
    sock = _connect(server, source)
    sock.sendall(head)
    sock.settimeout(0.25)
    answer = b""
    for i in range(len(trickle)):
        try:
            chunk = sock.recv(65536)
            if not chunk:  # closed by the server
                sock.close()
                return answer, True
            answer += chunk
        except TimeoutError:
            pass
        try:
            sock.sendall(trickle[i : i + 1])
        except ConnectionError:
            sock.close()
            return answer, True
    sock.close()
    return answer, False


@pytest.mark.slow
def test_idle_connections_are_closed_after_the_header_timeout(server) -> None:
    idle = [_connect(server, "127.0.0.2") for _ in range(20)]
    assert _held(server, server.baseline + 20)  # each one holds a descriptor
    assert _completion(server).choices[0].finish_reason == "length"  # others are served
    start = time.monotonic()
    for sock in idle:
        assert _read_to_close(sock) == b""  # sent nothing, so it gets no answer: just closed
        sock.close()
    assert time.monotonic() - start >= HEADER_TIMEOUT / 4  # the timeout, not a refusal
    _back_to_baseline(server)


@pytest.mark.slow
def test_a_slow_header_is_408_and_closed(server) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    answer, cut = _slow_sender(server, "127.0.0.2", head, b"X-Slow: " + b"s" * 400)
    assert cut, "the server waited 100 s for the headers"
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == 408 and "headers did not arrive" in error["message"]
    # The same on a kept-alive connection: its next request's head is timed from its first byte.
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536)
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        answers = first + _read_to_close(sock)
    assert answers.startswith(b"HTTP/1.1 200 ") and answers.count(b"HTTP/1.1 408 ") == 1
    _back_to_baseline(server)


@pytest.mark.slow
def test_a_slow_body_is_408_and_closed(server) -> None:
    body = b'{"prompt": "' + b"b" * 400 + b'", "max_tokens": 1}'
    answer, cut = _slow_sender(server, "127.0.0.2", POST_HEAD % len(body), body)
    assert cut, "the server waited 100 s for the body"
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
    assert b"body stopped arriving" in answer
    # A body that comes in a few pieces, each well within the timeout, is served.
    body = json.dumps({"model": "demo", "prompt": "Hi", "max_tokens": 2}).encode()
    sock = _connect(server)
    sock.sendall(POST_HEAD % len(body))
    for piece in (body[:10], body[10:20], body[20:]):
        time.sleep(BODY_TIMEOUT / 8)
        sock.sendall(piece)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    sock.close()
    _back_to_baseline(server)


@pytest.mark.slow
def test_a_long_stream_is_not_timed_out(server) -> None:
    """Only reading the request is timed: a stream that outlasts every timeout finishes."""
    body = {"model": "demo", "prompt": "Stream", "max_tokens": 40, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start, events, last = time.monotonic(), [], ""
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=WAIT) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) <= 7:
                    time.sleep(HEADER_TIMEOUT / 3)  # a slow reader: 4.7 s in all, at least
            last = line or last
    assert time.monotonic() - start > 2 * max(HEADER_TIMEOUT, BODY_TIMEOUT)
    assert last == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_over_a_cap_the_oldest_idle_connection_makes_room(server) -> None:
    # One client at its cap: its next connection closes its own oldest idle one.
    mine = [_connect(server, "127.0.0.3") for _ in range(PER_CLIENT)]
    newest = _connect(server, "127.0.0.3")
    assert _read_to_close(mine[0]) == b""
    assert all(_is_open(s) for s in [*mine[1:], newest])
    # The server at its cap (30 + 10 idle): a new client still gets in, the oldest idle goes.
    others = [_connect(server, "127.0.0.4") for _ in range(MAX_CONNECTIONS - PER_CLIENT)]
    assert _completion(server).choices[0].finish_reason == "length"
    assert _read_to_close(mine[1]) == b""
    assert _fds(server) <= server.baseline + MAX_CONNECTIONS + 3
    for sock in [*mine, newest, *others]:
        sock.close()
    _back_to_baseline(server)


class _Busy:
    """Connections in the middle of a request: each sends its body a byte every 0.4 s (a
    thread's work), well within the body timeout, so none may be closed to make room."""

    def __init__(self, server) -> None:
        self.server, self.socks = server, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, daemon=True)

    def __enter__(self) -> _Busy:
        self._thread.start()
        return self

    def open(self, source: str, count: int) -> None:
        for _ in range(count):
            sock = _connect(self.server, source)
            sock.sendall(POST_HEAD % 100_000 + b'{"prompt": "')
            self.socks.append(sock)

    def _feed(self) -> None:
        while not self._stop.wait(0.4):
            for sock in list(self.socks):
                sock.sendall(b"b")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self.socks:
            sock.close()


@pytest.mark.slow
def test_when_nothing_is_idle_the_cap_refuses_with_503_and_serving_goes_on(server) -> None:
    with _Busy(server) as busy:
        busy.open("127.0.0.5", PER_CLIENT)
        with _connect(server, "127.0.0.5") as refused:
            answer = _read_to_close(refused)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in answer.lower()
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 503
        assert _completion(server).choices[0].finish_reason == "length"  # another client
        busy.open("127.0.0.6", MAX_CONNECTIONS - PER_CLIENT)
        full = httpx.get(f"{server.base_url}/health", timeout=WAIT)
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert all(_is_open(sock) for sock in busy.socks)  # none was closed for room
    _back_to_baseline(server)
    assert _completion(server).choices[0].finish_reason == "length"
    assert httpx.get(f"{server.base_url}/health", timeout=WAIT).status_code == 200


def test_the_default_caps_leave_a_reserve_of_the_open_file_limit() -> None:
    # (total, per client, refusals draining at once) for a limit with 16 descriptors in use.
    assert connection_caps(None, None, 20000, 16) == (18734, 9367, 625)  # reserve 1/16
    assert connection_caps(None, None, 1024, 16) == (944, 944, 32)  # reserve 64; 1024 a client
    assert connection_caps(None, None, 2**20, 16)[:2] == (65536, 32768)  # memory: at most 64 Ki
    assert connection_caps(50_000, 10, 1024, 16) == (944, 10, 32)  # lowered to what fits

"""Connection attacks against a real `conveyor serve` (issue 49, item 6).

Each attack opens its connections from loopback addresses of its own (127.0.0.2 and up; Linux
routes all of 127.0.0.0/8 to loopback), holds them for --hold seconds and then lets go, while
a steady client on 127.0.0.1 sends a short completion every 0.5 s, each on a new connection.
Recorded per attack: the server process's file descriptors (/proc/PID/fd: before, at the
peak, at the end of the hold, after letting go) and resident memory, how many attack
connections were opened and how many the server still held at the end of the hold, what the
server answered the slow ones, and the steady client's statuses and seconds (p50, max):

    idle           3,000 connections that send nothing
    slow-header    300 connections sending a header byte every second
    slow-body      300 connections with complete headers sending a body byte every second
    flood          28,000 connections that send nothing, from 28 addresses and 4 processes
                   (more than the 20,000 descriptors a process has on the issue's machine)

It starts `conveyor serve` on the demo model (or --model DIR) with the default settings;
--src DIR runs another checkout's src/ instead (say, `git archive` of an older commit), for a
before / after. stdout has one JSON object; progress goes to stderr. The machine may be
shared: look at the statuses, the counts and the orders of magnitude.

    python benchmarks/connection_attacks.py [--hold 30] [--src /tmp/old/src]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_server import start_server

POST_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 100000\r\n\r\n"
)


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


class Server:
    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc, self.port = proc, port
        self.peak = 0

    def fds(self) -> int:
        count = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        self.peak = max(self.peak, count)
        return count

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        return round(kib / 1024, 1)


class Steady:
    """A completion every 0.5 s, each on a new connection: (status or error, seconds, when)."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.results: list[tuple[str, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {"model": "demo", "prompt": "steady", "max_tokens": 4}
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                status = str(httpx.post(self.url, json=body, timeout=10).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            self.results.append((status, time.monotonic() - start, start))
            self._stop.wait(max(0.0, 0.5 - (time.monotonic() - start)))

    def stop(self, attack_start: float) -> dict[str, Any]:
        """The summary; `max_at_s`: when the slowest request began, from the attack's start."""
        self._stop.set()
        self._thread.join(30)
        if not self.results:
            return {"requests": 0}
        seconds = [s for _, s, _ in self.results]
        slowest = max(self.results, key=lambda r: r[1])
        return {
            "requests": len(self.results),
            "statuses": dict(Counter(status for status, _, _ in self.results)),
            "p50_s": round(statistics.median(seconds), 3),
            "max_s": round(slowest[1], 3),
            "max_at_s": round(slowest[2] - attack_start, 1),
        }


def connect(port: int, source: str) -> socket.socket | None:
    sock = socket.socket()
    sock.settimeout(2)  # a full accept queue leaves connect() hanging
    try:
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def still_open(sock: socket.socket) -> bool:
    """Not closed by the server (recv would return b"" or fail)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:  # nothing to read: open
        return True
    except OSError:
        return False


def answer_of(sock: socket.socket) -> str:
    """The status the server answered before it closed, "closed" for none, "open" if open."""
    sock.setblocking(False)
    try:
        data = sock.recv(4096)
    except BlockingIOError:
        return "open"
    except OSError:
        return "reset"
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"


def flood_worker(port: int, sources: list[str], per_source: int, hold: float, out: Any) -> None:
    """Open per_source connections from each source (for at most half the hold: a server that
    no longer accepts makes each try wait 2 s), hold them, report, let go when told."""
    start, socks, failed = time.monotonic(), [], 0
    for source in sources:
        for _ in range(per_source):
            sock = connect(port, source) if time.monotonic() - start < hold / 2 else None
            if sock is None:
                failed += 1
            else:
                socks.append(sock)
    time.sleep(max(0.0, start + hold - 3 - time.monotonic()))  # report near the hold's end
    out.send({"opened": len(socks), "failed": failed,
              "open_at_end": sum(still_open(s) for s in socks)})  # fmt: skip
    out.recv()  # let go
    for sock in socks:
        sock.close()


def attack(server: Server, name: str, hold: float) -> dict[str, Any]:
    baseline, server.peak = server.fds(), 0
    steady = Steady(server.port)
    time.sleep(1)
    start, socks, failed, extra = time.monotonic(), [], 0, {}
    workers: list[tuple[Any, Any]] = []
    if name == "flood":
        ctx = multiprocessing.get_context("spawn")
        for w in range(4):
            ours, theirs = ctx.Pipe()
            sources = [f"127.0.1.{10 + 7 * w + i}" for i in range(7)]
            proc = ctx.Process(target=flood_worker, args=(server.port, sources, 1000, hold,
                                                          theirs))  # fmt: skip
            proc.start()
            workers.append((proc, ours))
    else:
        count, source = {"idle": (3000, "127.0.0.2"), "slow-header": (300, "127.0.0.3"),
                         "slow-body": (300, "127.0.0.4")}[name]  # fmt: skip
        for _ in range(count):
            sock = connect(server.port, source)
            if sock is None:
                failed += 1
                continue
            socks.append(sock)
            if name == "slow-header":
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            elif name == "slow-body":
                sock.sendall(POST_HEAD + b'{"prompt": "')
    while time.monotonic() - start < hold - 1:  # trickle a byte a second; watch the peak
        for sock in socks if name != "idle" else ():
            with contextlib.suppress(OSError):  # closed by the server
                sock.sendall(b"a" if name == "slow-body" else b"X")
        server.fds()
        time.sleep(1)
    end_fds, rss = server.fds(), server.rss_mib()
    if workers:
        reports = [ours.recv() for _, ours in workers]
        extra = {k: sum(r[k] for r in reports) for k in ("opened", "failed", "open_at_end")}
        for proc, ours in workers:
            ours.send("go")
            proc.join(60)
    else:
        answers = Counter(answer_of(s) for s in socks)
        extra = {"opened": len(socks), "failed": failed, "open_at_end": answers.pop("open", 0),
                 "answers": dict(answers)}  # fmt: skip
        for sock in socks:
            sock.close()
    time.sleep(3)
    result = {"attack_seconds": hold, **extra,
              "server_fds": {"before": baseline, "peak": server.peak,
                             "end_of_hold": end_fds, "after_letting_go": server.fds()},
              "server_rss_mib_end_of_hold": rss, "steady": steady.stop(start)}  # fmt: skip
    log(name, json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the demo model)")
    parser.add_argument("--src", help="serve another checkout's src/ folder (PYTHONPATH)")
    parser.add_argument("--hold", type=float, default=30.0, help="seconds each attack lasts")
    parser.add_argument("--attacks", nargs="+", default=["idle", "slow-header", "slow-body",
                                                         "flood"])  # fmt: skip
    args = parser.parse_args(argv)
    proc, url = start_server([], args.model, args.src)
    port = int(url.rsplit(":", 1)[1])
    server = Server(proc, port)
    try:
        report: dict[str, Any] = {"src": args.src or "this checkout", "hold_s": args.hold,
                                  "idle_server_fds": server.fds(), "attacks": {}}  # fmt: skip
        for name in args.attacks:
            log(f"attack: {name}")
            report["attacks"][name] = attack(server, name, args.hold)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

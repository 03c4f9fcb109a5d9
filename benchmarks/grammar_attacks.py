"""Structured-output attacks against a real `conveyor serve` (issue 27, items 2, 3 and 6).

Each attack is sent as the issue describes it; each answer's HTTP status and seconds are
recorded. Meanwhile a probe client streams an unconstrained completion (ignore_eos, one
request after another) and records the time of every SSE event: its longest gap between two
events during an attack is what that attack cost another client. The attacks:

    optional-3000 x2     two 94 KB schemas of 3,000 optional properties at once
    big-schemas+regex    two ~170 KB schemas abandoned by their clients after 1 s, two slow
                         schemas within the limits (7 objects x 250 optional properties,
                         ~1 s of compiling each), then a trivial regex [0-9]{2}w
    deadline             a request with "deadline": 2.0 behind those slow compiles
    schemas+chat         twenty concurrent 13 KB invalid schemas, then a max_tokens 1 chat
    5000-properties, 100k-choices, pattern-5000
    item-6 shapes        regex [^\\s\\S], an allOf pointing at itself, allOf [string,
                         integer], a remote $ref, and named / required tool_choice with
                         parameters {"type":"banana"}, a false required property, a circular
                         $ref, a self-referencing allOf

Without --url it starts `conveyor serve` on the demo model (or --model DIR). stdout has one
JSON object; progress goes to stderr. A loaded machine is fine: the numbers to look at are
the statuses and the orders of magnitude.

    python benchmarks/grammar_attacks.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ASK = [{"role": "user", "content": "Answer in JSON."}]


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def start_server(model: str | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(sys.executable).with_name("conveyor")
    found = str(script) if script.is_file() else shutil.which("conveyor")
    command = [found] if found else [sys.executable, "-m", "conveyor.cli"]
    command += ["serve", "--port", str(port), "--log-level", "warning", "--log-stats-interval",
                "0", "--served-model-name", "demo"]  # fmt: skip
    if model:
        command += ["--model", model]
    proc = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 300
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"conveyor serve exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("conveyor serve did not become healthy")


class Probe:
    """Streams completions back to back; `max_gap(start, end)`: the longest wait between
    events (or from `start` to the first) within [start, end]."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        while not self.times:  # streaming before any attack starts
            time.sleep(0.05)

    def _run(self) -> None:
        body = {"model": "demo", "prompt": "probe", "max_tokens": 1500, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.Client(timeout=600) as client:
            while not self._stop.is_set():
                url = f"{self.url}/v1/completions"
                with client.stream("POST", url, json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data:"):
                            self.times.append(time.monotonic())
                        if self._stop.is_set():
                            break

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def max_gap(self, start: float, end: float) -> float:
        times = [start] + [t for t in self.times if start < t <= end] + [end]
        return max(b - a for a, b in itertools.pairwise(times))


def post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    start = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "demo", "messages": ASK,
                       "max_tokens": 4, **body}, timeout=timeout)  # fmt: skip
        status, data = r.status_code, r.json()
    except httpx.TimeoutException:
        status, data = "abandoned", {}
    seconds = round(time.monotonic() - start, 3)
    out: dict[str, Any] = {"status": status, "seconds": seconds}
    if isinstance(data.get("error"), dict):
        out["param"] = data["error"].get("param")
        out["message"] = str(data["error"].get("message"))[:160]
    elif data.get("choices"):
        out["finish_reason"] = data["choices"][0].get("finish_reason")
    return out


def schema(s: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}


def optional(n: int, tag: str = "p") -> dict[str, Any]:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(n)}}


def slow(tag: str) -> dict[str, Any]:
    """Within every limit, ~1 s of compiling on the demo model."""
    return {"type": "object", "properties": {f"o{j}": optional(250, tag) for j in range(7)}}


def tool_body(parameters: dict[str, Any], mode: str) -> dict[str, Any]:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    choice = {"type": "function", "function": {"name": "f"}} if mode == "named" else "required"
    return {"tools": tools, "tool_choice": choice}


def attacks(url: str, windows: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Run every attack; name -> its answers (and extra numbers). `windows` gets each
    phase's (start, end) for the probe's gaps."""
    results: dict[str, Any] = {}
    with ThreadPoolExecutor(24) as pool:
        t0 = time.monotonic()
        big = [pool.submit(post, url, schema(optional(3000, f"a{i}"))) for i in range(2)]
        results["optional-3000 x2"] = [f.result() for f in big]
        windows["grammar: optional-3000 x2"] = (t0, time.monotonic())

        t0 = time.monotonic()
        # ~170 KB each: 6,000 properties with long names, abandoned after 1 s.
        huge = [pool.submit(post, url, schema(optional(6000, f"abandoned_{i}_")), 1.0)
                for i in range(2)]  # fmt: skip
        slow_ones = [pool.submit(post, url, schema(slow(f"s{i}"))) for i in range(2)]
        time.sleep(0.3)
        regex = pool.submit(post, url, {"guided_regex": "[0-9]{2}w", "max_tokens": 8})
        deadline = pool.submit(post, url, {**schema(slow("late")), "deadline": 2.0})
        results["big-schemas+regex"] = {
            "abandoned ~170 KB": [f.result() for f in huge],
            "slow within limits": [f.result() for f in slow_ones],
            "regex [0-9]{2}w": regex.result(),
        }
        results["deadline 2.0 behind compiles"] = deadline.result()
        windows["grammar: big schemas, regex, deadline"] = (t0, time.monotonic())

        pattern = {"type": "string", "pattern": "[a-z]{1,5000}"}
        bad = {"type": "object", "properties": {f"p{i}": pattern for i in range(200)},
               "description": "x" * 4000, "unknown": {"type": "banana"}}  # fmt: skip
        t0 = time.monotonic()
        floods = [pool.submit(post, url, schema(bad)) for _ in range(20)]
        time.sleep(0.2)
        chat = post(url, {"max_tokens": 1})
        flood = [f.result() for f in floods]
        windows["schema: 20 invalid schemas + chat"] = (t0, time.monotonic())
        results["schemas+chat"] = {
            "schema bytes": len(json.dumps(bad)),
            "statuses": sorted({str(f["status"]) for f in flood}),
            "slowest schema s": max(f["seconds"] for f in flood),
            "chat max_tokens 1": chat,
        }

    required = {**optional(5000), "required": [f"p{i}" for i in range(5000)]}
    results["5000-properties"] = post(url, schema(required))
    results["100k-choices"] = post(
        url, {"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}
    )
    results["pattern-5000"] = post(url, schema({"type": "string", "pattern": "[a-z]{1,5000}"}))

    circular = {
        "$ref": "#/$defs/a",
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
    }
    self_allof = {"allOf": [{"$ref": "#"}]}
    shapes: dict[str, dict[str, Any]] = {
        "regex [^\\s\\S]": {"guided_regex": r"[^\s\S]"},
        "allOf -> itself": schema(self_allof),
        "allOf [string, integer]": schema({"allOf": [{"type": "string"}, {"type": "integer"}]}),
        "remote $ref": schema({"$ref": "https://example.com/person.json"}),
    }
    tool_shapes = {"banana": {"type": "banana"},
                   "false required": {"properties": {"x": False}, "required": ["x"]},
                   "circular $ref": circular, "self allOf": self_allof}  # fmt: skip
    for name, parameters in tool_shapes.items():
        for mode in ("named", "required"):
            shapes[f"tool {mode}: {name}"] = tool_body(parameters, mode)
    t0 = time.monotonic()
    results["item-6 shapes"] = {name: post(url, body) for name, body in shapes.items()}
    windows["schema: item-6 shapes"] = (t0, time.monotonic())
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--model", help="checkpoint folder for the started server (demo)")
    args = parser.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model)
    try:
        probe = Probe(url)
        probe.start()
        windows: dict[str, tuple[float, float]] = {}
        start = time.monotonic()
        results = attacks(url, windows)
        end = time.monotonic()
        probe.stop()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    report = {
        "attacks": results,
        "probe_max_gap_s": {
            name: round(probe.max_gap(a, b), 3) for name, (a, b) in windows.items()
        },
        "probe_max_gap_all_s": round(probe.max_gap(start, end), 3),
        "probe_events": len(probe.times),
        "attack_seconds": round(end - start, 1),
    }
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

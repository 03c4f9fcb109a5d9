"""Structured-output attacks against a real `conveyor serve` (issue 27, items 2, 3 and 6;
issue 49, items 1, 2 and 8).

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

Issue 49's, with a steady client beside them (short chat requests back to back: plain,
json_object, a small schema, in turn; its p50 / max latency per attack, against its own
unloaded p50), and the server's memory (its whole process tree's RSS):

    infinite-grammar     root ::= "a" root (17 characters) and a 4,096+ character variant
    runaway-compiles     two 3,400-character regexes of 680 optional groups and two 63 KB
                         grammars of 2,900 optional terms, sent together

Without --url it starts `conveyor serve` on the demo model (or --model DIR). stdout has one
JSON object; progress goes to stderr. A loaded machine is fine: the numbers to look at are
the statuses and the orders of magnitude. `--round3` runs issue 49's attacks only.

    python benchmarks/grammar_attacks.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_server import start_server

ASK = [{"role": "user", "content": "Answer in JSON."}]


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


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


class Steady:
    """Short chat requests back to back (8 tokens; plain, json_object and a small schema in
    turn); `latencies(start, end)`: those that ended within [start, end]."""

    BODIES: tuple[dict[str, Any], ...] = (
        {},
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"n": {"type": "integer"}}}}}},
    )  # fmt: skip

    def __init__(self, url: str) -> None:
        self.url = url
        self.done: list[tuple[float, float]] = []  # (end, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=600) as client:
            for body in itertools.cycle(self.BODIES):
                if self._stop.is_set():
                    return
                t0 = time.monotonic()
                client.post(f"{self.url}/v1/chat/completions", json={
                    "model": "demo", "messages": ASK, "max_tokens": 8, **body})  # fmt: skip
                self.done.append((time.monotonic(), time.monotonic() - t0))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(600)

    def summary(self, start: float, end: float) -> dict[str, float | int]:
        seconds = sorted(s for t, s in self.done if start < t <= end)
        if not seconds:
            return {"n": 0}
        return {"n": len(seconds), "p50_s": round(seconds[len(seconds) // 2], 3),
                "max_s": round(seconds[-1], 3)}  # fmt: skip


def tree_rss_mb(pid: int) -> float:
    """RSS of pid and its descendants (the API server, engine, grammar worker, checks)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += parents.get(p, [])
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += int(next((ln.split()[1] for ln in status.splitlines()
                           if ln.startswith("VmRSS:")), "0"))  # fmt: skip
    return round(total / 1024, 1)


def optional_groups(tag: str) -> str:
    return tag + "".join(f"({chr(97 + i % 26)}{chr(65 + i * 7 % 26)})?" for i in range(680))


def optional_terms(tag: str) -> str:
    """~63 KB: 2,900 optional terms of 18 letters."""
    words = (f"{tag}{i:05d}{'x' * 12}" for i in range(2900))
    return "root ::= " + " ".join(f'"{w}"?' for w in words)


def round3(url: str, pid: int | None, steady: Steady) -> dict[str, Any]:
    """Issue 49's attacks, each with the steady client's latencies beside it."""
    results: dict[str, Any] = {}
    while len(steady.done) < 2 * len(steady.BODIES):  # warm: compiled once, worker started
        time.sleep(0.1)
    t0 = time.monotonic()
    time.sleep(5)
    results["unloaded"] = {"steady": steady.summary(t0, time.monotonic())}
    infinite = 'root ::= "a" root'
    big = infinite + "".join(f'\nr{i} ::= "{"x" * 40}"' for i in range(100))
    for name, grammar in (("infinite-grammar 17 chars", infinite),
                          ("infinite-grammar 4,096+ chars", big)):  # fmt: skip
        rss = tree_rss_mb(pid) if pid else None
        t0 = time.monotonic()
        answer = post(url, {"structured_outputs": {"grammar": grammar}}, timeout=120)
        time.sleep(2)
        results[name] = {
            "answer": answer,
            "steady": steady.summary(t0, time.monotonic()),
            "rss_mb_before": rss,
            "rss_mb_after": tree_rss_mb(pid) if pid else None,
        }
    with ThreadPoolExecutor(4) as pool:
        t0 = time.monotonic()
        sent = [pool.submit(post, url, {"guided_regex": optional_groups(t)}) for t in "xy"]
        sent += [pool.submit(post, url, {"guided_grammar": optional_terms(t)}) for t in "ab"]
        answers = [f.result() for f in sent]
        end = time.monotonic()
        time.sleep(5)
        results["runaway-compiles"] = {
            "answers": answers, "steady": steady.summary(t0, end),
            "steady after (5 s)": steady.summary(end, time.monotonic()),
        }  # fmt: skip
    return results


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
    parser.add_argument("--round3", action="store_true", help="issue 49's attacks only")
    args = parser.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server([], args.model)
    if args.round3:
        steady = Steady(url)
        steady.start()
        try:
            report = round3(url, proc.pid if proc else None, steady)
        finally:
            steady.stop()
            if proc is not None:
                proc.terminate()
                proc.wait(60)
        print(json.dumps(report, indent=1))
        return report
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

"""Load and chaos against a real `conveyor serve` with a KV cache far smaller than the load:
500 streams at once, 30% of the clients leave mid-stream (after 1 to 3 deltas of an output too
long to finish first, so the count of real disconnects does not depend on the machine's speed).
Every stream that stays gets its full length, each one that left is aborted, the server
preempts instead of stalling, stays healthy, and ends with no running or waiting request and
no KV block in use. Plus `conveyor bench serve` end to end."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from tests.serve_process import metric_value, start_server

from conveyor.cli import main

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

NUM_BLOCKS = 32  # 512 slots for 500 requests of up to ~26 tokens each (and the leavers)
NUM_REQUESTS = 500
DISCONNECT_FRACTION = 0.3
# A leaver asks for this many tokens and leaves after a few deltas: it cannot finish first.
# Prompt + output still fits the whole cache (512 slots), so the request is admitted.
LEAVER_MAX_TOKENS = 400


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    args = ["--model", str(demo_model_dir), "--num-kv-blocks", str(NUM_BLOCKS)]
    args += ["--max-num-seqs", "64", "--max-waiting-requests", "5000"]
    proc = start_server(args, tmp_path_factory.mktemp("load"))
    yield proc
    proc.stop()


async def _client(
    http: httpx.AsyncClient, i: int, leave_after: int | None, max_tokens: int
) -> tuple[str, int]:
    """One streaming request; returns ("completed" | "disconnected" | "failed", tokens).

    A client with `leave_after` closes its connection once it has read that many deltas
    without a finish among them; it would finish first only if the server folded
    LEAVER_MAX_TOKENS steps into a few chunks, so how many clients really disconnect does not
    depend on how fast the machine runs or how the deltas are chunked. A leaver that saw its
    finish is "failed": the test could not exercise its disconnect.
    """
    body = {
        "prompt": f"Load test request {i}:", "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    finish, tokens, deltas = None, 0, 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return "failed", 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "failed", tokens
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                deltas += 1
                finish = choice["finish_reason"] or finish
            if leave_after is not None and finish is None and deltas >= leave_after:
                return "disconnected", deltas  # leaving the block closes the connection
    ok = leave_after is None and finish == "length" and tokens == max_tokens
    return ("completed" if ok else "failed"), tokens


def _plan(rng: random.Random) -> list[tuple[int | None, int]]:
    """(leave_after, max_tokens) for each client: exactly DISCONNECT_FRACTION of them leave,
    after 1 to 3 deltas of a long output; the others want 4 to 16 tokens."""
    leavers = set(rng.sample(range(NUM_REQUESTS), round(DISCONNECT_FRACTION * NUM_REQUESTS)))
    return [
        (rng.randint(1, 3), LEAVER_MAX_TOKENS) if i in leavers else (None, rng.randint(4, 16))
        for i in range(NUM_REQUESTS)
    ]


def _metrics(server) -> str:
    return httpx.get(f"{server.base_url}/metrics").text


def _finished(text: str, reason: str) -> float:
    return metric_value(text, "conveyor:request_success_total", finished_reason=reason)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_500_streams_with_30_percent_disconnects_complete_and_leak_nothing(server) -> None:
    plan = _plan(random.Random(1234))

    async def run() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=server.base_url, limits=limits, timeout=httpx.Timeout(120.0)
        ) as http:
            clients = (_client(http, i, *p) for i, p in enumerate(plan))
            return await asyncio.gather(*clients)

    before = _metrics(server)
    results = asyncio.run(run())
    counts = {k: sum(1 for r in results if r[0] == k) for k in ("completed", "disconnected")}
    counts["failed"] = NUM_REQUESTS - sum(counts.values())
    expected = {"length": counts["completed"], "abort": counts["disconnected"], "stop": 0}
    deadline = time.monotonic() + 60
    while True:  # disconnects are noticed asynchronously: wait for the aborts to land
        text = _metrics(server)
        state = [
            metric_value(text, f"conveyor:{name}")
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        ]
        finished = {
            reason: _finished(text, reason) - _finished(before, reason) for reason in expected
        }
        if (state == [0, 0, 0] and finished == expected) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    counts["leaked_blocks"] = round(state[2] * NUM_BLOCKS)
    counts["preemptions"] = int(metric_value(text, "conveyor:num_preemptions_total"))
    print(f"\nload test: {json.dumps(counts)}")
    assert counts["failed"] == 0
    assert counts["disconnected"] == sum(1 for leave_after, _ in plan if leave_after)
    # The engine counted every stream once, by how it ended: each disconnect is an abort,
    # each completed stream a "length".
    assert finished == expected
    assert state == [0, 0, 0]  # no running, no waiting, no KV block in use
    assert counts["preemptions"] > 0  # the cache was too small: it preempted, not stalled
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    resp = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "ok", "max_tokens": 3})
    assert resp.json()["usage"]["completion_tokens"] == 3


def test_bench_serve_reports_like_vllm_bench_serve(server, tmp_path, capsys) -> None:
    result, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    common = ["bench", "serve", "--base-url", server.base_url, "--output-len", "6"]
    args = [*common, "--num-prompts", "12", "--input-len", "8", "--request-rate", "40"]
    args += ["--max-concurrency", "4", "--result-json", str(result), "--plot", str(plot)]
    assert main(args) == 0
    summary = json.loads(result.read_text())
    assert json.loads(capsys.readouterr().out) == summary
    assert (summary["successful_requests"], summary["failed_requests"]) == (12, 0)
    assert summary["total_output_tokens"] == 72 and summary["total_input_tokens"] == 96
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            assert summary[f"{stat}_{metric}_ms"] > 0
    assert summary["output_throughput"] > 0 and summary["request_throughput"] > 0
    assert plot.read_bytes().startswith(b"\x89PNG")

    dataset = tmp_path / "workload.jsonl"
    rows = [{"prompt": "Hello there", "max_tokens": 3}, {"prompt": [5, 6, 7], "max_tokens": 2}]
    dataset.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main([*common, "--dataset", str(dataset)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["successful_requests"] == 2 and summary["total_output_tokens"] == 5

    # Requests carry --served-model-name; by default the server's first /v1/models entry.
    served = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    assert summary["model"] == served
    assert main([*common, "--dataset", str(dataset), "--served-model-name", served]) == 0
    assert json.loads(capsys.readouterr().out)["successful_requests"] == 2
    assert main([*common, "--dataset", str(dataset), "--served-model-name", "not-served"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert (summary["model"], summary["failed_requests"]) == ("not-served", 2)
    assert "HTTP 404" in summary["errors"][0]

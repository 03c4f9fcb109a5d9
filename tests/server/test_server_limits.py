"""A real `conveyor serve` with tight limits: deadlines and the request timeout end requests with
finish_reason "abort" and say why; priority orders waiting work; a full waiting queue is a 503
with Retry-After; n above the cap is a 400; an oversized body is a 413. Every refusal has the
OpenAI error body, and the server serves normally afterwards."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from tests.serve_process import metric_value, slow_step_env, start_server

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

TIMEOUT_S = 3
# Every engine step takes at least this long, so a 2,040-token request cannot finish within
# TIMEOUT_S however fast the model runs (the demo model alone did it in under 3 s once the
# engine process stepped from the thread that built the engine).
STEP_S = 0.003
ARGS = [
    "--max-num-seqs", "1", "--max-waiting-requests", "2", "--max-n", "2",
    "--max-request-body-bytes", "4096", "--request-timeout", str(TIMEOUT_S),
    "--scheduler", "priority", "--num-kv-blocks", "160", "--served-model-name", "demo",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lim")
    args = ["--model", str(demo_model_dir), *ARGS]
    proc = start_server(args, tmp, env=slow_step_env(tmp, STEP_S))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _gauge(server, name: str) -> float:
    return metric_value(httpx.get(f"{server.base_url}/metrics").text, f"conveyor:{name}")


def _wait_for(server, name: str, value: float) -> None:
    deadline = time.monotonic() + 30
    while _gauge(server, name) != value:
        assert time.monotonic() < deadline, f"{name} never became {value}"
        time.sleep(0.02)


def _assert_error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    return error


def test_deadline_aborts_and_stop_reason_says_why(client) -> None:
    resp = client.completions.create(
        model="demo", prompt="Go on", max_tokens=2000,
        extra_body={"ignore_eos": True, "deadline": 0.2, "priority": 3, "length_hint": 50},
    )  # fmt: skip
    choice = resp.choices[0]
    assert choice.finish_reason == "abort" and resp.usage.completion_tokens < 2000
    assert choice.model_extra["stop_reason"].startswith("deadline exceeded: not finished 0.2 s")
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True, "deadline": 0.2},
    )  # fmt: skip
    last = list(stream)[-1].choices[0]
    assert last.finish_reason == "abort" and "deadline exceeded" in last.model_extra["stop_reason"]


def test_request_timeout_caps_every_deadline(server) -> None:
    for extra in ({}, {"deadline": 100}):
        body = {"prompt": "x", "max_tokens": 2040, "ignore_eos": True, **extra}
        resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "abort"
        assert (
            choice["stop_reason"] == f"deadline exceeded: not finished {TIMEOUT_S} s after arrival"
        )


def test_priority_orders_waiting_work_and_a_full_queue_is_503(server) -> None:
    url = f"{server.base_url}/v1/completions"

    async def run() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(timeout=60) as http:

            async def short(name: str, priority: int) -> None:
                body = {"prompt": name, "max_tokens": 4, "priority": priority, "length_hint": 4}
                resp = await http.post(url, json=body)
                assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")
                finished.append(name)

            blocker = {"prompt": "block", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            async with http.stream("POST", url, json=blocker) as running:
                lines = running.aiter_lines()
                await anext(lines)  # the blocker runs (max_num_seqs is 1)
                low = asyncio.ensure_future(short("low", 10))
                await asyncio.to_thread(_wait_for, server, "num_requests_waiting", 1)
                high = asyncio.ensure_future(short("high", 1))
                await asyncio.to_thread(_wait_for, server, "num_requests_waiting", 2)
                full = await http.post(url, json={"prompt": "one too many"})
                error = _assert_error(full, 503, None)
                assert error["type"] == "ServiceUnavailableError"
                assert full.headers["retry-after"] == "1"
            # Leaving the stream aborts the blocker; then the higher priority runs first.
            await asyncio.gather(low, high)
        return finished

    assert asyncio.run(run()) == ["high", "low"]
    _wait_for(server, "num_requests_running", 0)


def test_n_cap_is_400_and_oversized_bodies_are_413(server) -> None:
    url = f"{server.base_url}/v1/completions"
    _assert_error(httpx.post(url, json={"prompt": "x", "n": 3}), 400, "n")
    assert httpx.post(url, json={"prompt": "x", "n": 2, "max_tokens": 2}).status_code == 200
    big = {"prompt": "x" * 5000}
    error = _assert_error(httpx.post(url, json=big), 413, None)
    assert "4096 bytes" in error["message"]

    def chunked():  # no Content-Length: counted while read
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    resp = httpx.post(url, content=chunked(), headers={"Content-Type": "application/json"})
    _assert_error(resp, 413, None)
    assert httpx.post(url, json={"prompt": "still fine", "max_tokens": 2}).status_code == 200
    assert httpx.get(f"{server.base_url}/health").status_code == 200

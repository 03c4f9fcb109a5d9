"""One request must not hold up everyone else (issue 49 item 4), against a real `conveyor
serve` on the demo model.

A long prompt, or an embeddings batch of many long inputs, used to take each step's whole
token budget until it was done, so a short chat request sent meanwhile waited for all of it.
Now long prefills share each step with the other requests (core/chunking.py): steady short
chat requests, sent one after another beside the long work, finish while it is still in
progress. Counted in requests and ordered by events, never timed. Plus the per-client limits
on sequences and tokens in flight (server/admission.py): n x prompt counts against them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest
from tests.serve_process import metric_value, slow_step_env, start_server

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

STEADY = {
    "model": "demo",
    "messages": [{"role": "user", "content": "Say hi."}],
    "max_tokens": 8,
    "ignore_eos": True,
    "temperature": 0,
}
# Steady requests that must finish, after the long work was sent and before it is done.
PASSED = 4
# The threshold is low here so that the long work, alone between two steady requests, still
# needs many steps (the demo model's steps are fast); the budget is small for the same reason.
ARGS = [
    "--served-model-name", "demo", "--num-kv-blocks", "1024",
    "--max-num-batched-tokens", "512", "--long-prefill-token-threshold", "32",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    proc = start_server(["--model", str(demo_model_dir), *ARGS], tmp_path_factory.mktemp("fair"))
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log()


async def _steady(http: httpx.AsyncClient, since: list[float], done: list[float]) -> None:
    """Short chat requests back to back; `done` gets the end of each one that started after
    `since[0]` (set when the long work is sent), until PASSED of them finished."""
    while len(done) < PASSED:
        start = time.monotonic()
        resp = await http.post("/v1/chat/completions", json=STEADY)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 8
        if since and start >= since[0]:
            done.append(time.monotonic())


async def _beside(http: httpx.AsyncClient, attack) -> tuple[list[float], float]:
    """Run two steady clients (so one is always in flight), send `attack` once both have
    finished a request, and return the steady ends after it was sent and when the attack's
    first output arrived (the long work was done by then)."""
    warm = await http.post("/v1/chat/completions", json=STEADY)  # its prefix is cached now
    assert warm.status_code == 200, warm.text
    since: list[float] = []
    done: list[float] = []
    steady = [asyncio.create_task(_steady(http, since, done)) for _ in range(2)]
    await asyncio.sleep(0)
    since.append(time.monotonic())
    first_output = await attack(http)
    await asyncio.gather(*steady)
    return done, first_output


async def _long_prompt(http: httpx.AsyncClient) -> float:
    """A 1,900-token prompt, streamed; returns when its first token arrived (its whole prompt
    was computed by then) after checking that it finishes normally."""
    body = {"model": "demo", "prompt": [(7 * i) % 8000 + 10 for i in range(1900)],
            "max_tokens": 4, "ignore_eos": True, "stream": True}  # fmt: skip
    first, finish = None, None
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            first = first or time.monotonic()
            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    assert finish == "length"
    assert first is not None
    return first


async def _embeddings_batch(http: httpx.AsyncClient) -> float:
    """24 inputs of 500 token ids in one request; returns when its answer arrived."""
    inputs = [[(13 * i + j) % 8000 + 10 for j in range(500)] for i in range(24)]
    resp = await http.post("/v1/embeddings", json={"model": "demo", "input": inputs})
    assert resp.status_code == 200, resp.text
    data = resp.json()["data"]
    assert [d["index"] for d in data] == list(range(24))
    assert resp.json()["usage"]["prompt_tokens"] == 24 * 500
    return time.monotonic()


@pytest.mark.parametrize("attack", [_long_prompt, _embeddings_batch], ids=["long", "embeddings"])
def test_short_chat_requests_finish_while_long_prefills_are_still_in_progress(server, attack):
    # Before: the long work took every step's whole budget, so a chat request sent after it
    # was admitted only with its last chunk and finished after it (none of PASSED did).
    async def run() -> tuple[list[float], float]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
            return await _beside(http, attack)

    done, first_output = asyncio.run(run())
    assert len(done) >= PASSED
    finished_before = [t for t in done if t < first_output]
    assert len(finished_before) >= PASSED, (
        f"{len(finished_before)} of the steady requests sent after the long work finished "
        "before it did"
    )


# --- per-client limits ---------------------------------------------------------------------

ATTACKER, OTHER = "sk-attacker", "sk-other"


@pytest.fixture(scope="module")
def limited(demo_model_dir, tmp_path_factory):
    args = [
        "--model", str(demo_model_dir), "--served-model-name", "demo", "--num-kv-blocks", "512",
        "--api-key", ATTACKER, OTHER, "--max-client-sequences", "16",
        "--max-client-tokens", "6000",
    ]  # fmt: skip
    # Steps of 20 ms: a request of 300 tokens stays in flight for seconds, however fast the
    # machine (on the demo model it would finish before the next request is even read).
    tmp = tmp_path_factory.mktemp("limited")
    proc = start_server(args, tmp, env=slow_step_env(tmp, 0.02))
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log()


def _client(server, key: str) -> httpx.Client:
    auth = {"Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=server.base_url, headers=auth, timeout=120)


def _metric(server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return metric_value(text, name, **labels)


def _aborted(server) -> float:
    return _metric(server, "conveyor:request_success_total", finished_reason="abort")


@contextlib.contextmanager
def _in_flight(server, key: str, body: dict):
    """`body` sent by `key`'s client from a thread, yielded once the engine has made a token
    for each of its n sequences (it is charged to its client by then); on exit the client
    leaves, which aborts it."""
    before = _metric(server, "conveyor:generation_tokens_total")
    http = _client(server, key)

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError, RuntimeError):
            http.post("/v1/completions", json=body)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while _metric(server, "conveyor:generation_tokens_total") < before + body["n"]:
        assert time.monotonic() < deadline, "the request in flight made no tokens"
        time.sleep(0.05)
    try:
        yield
    finally:
        http.close()
        thread.join(60)


def test_a_clients_sequences_in_flight_count_n_and_beyond_its_limit_get_429(limited):
    # Issue 49: 4 x (n=16, 300 tokens) filled all 64 slots for two minutes.
    samples = {"model": "demo", "prompt": "Once upon a time", "n": 16, "max_tokens": 300,
               "ignore_eos": True, "logprobs": 5}  # fmt: skip
    with _client(limited, ATTACKER) as attacker, _client(limited, OTHER) as other:
        with _in_flight(limited, ATTACKER, samples):  # its 16 sequences are in flight
            second = attacker.post("/v1/completions", json=samples)
            assert second.status_code == 429
            assert second.headers["retry-after"] == "1"
            error = second.json()["error"]
            assert error["code"] == 429 and "sequences in flight" in error["message"]
            # Another client is not held up by the attacker's limit, nor its seats.
            resp = other.post("/v1/chat/completions", json={**STEADY, "max_tokens": 4})
            assert resp.status_code == 200
            assert resp.json()["usage"]["completion_tokens"] == 4
        # The attacker's first request ended (it left): its sequences no longer count.
        resp = attacker.post("/v1/completions", json={**samples, "n": 2, "max_tokens": 3})
        assert resp.status_code == 200
        assert len(resp.json()["choices"]) == 2


def test_n_times_prompt_and_max_tokens_count_against_a_clients_tokens(limited):
    prompt = list(range(10, 110))  # 100 tokens
    with _client(limited, ATTACKER) as attacker:
        # 16 x (100 + 300) = 6,400 tokens: more than one client may hold, alone: 400.
        resp = attacker.post("/v1/completions", json={"model": "demo", "prompt": prompt,
                             "n": 16, "max_tokens": 300})  # fmt: skip
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "n" and "6400" in error["message"]
        # 8 x 400 = 3,200 in flight; a second one would make 6,400: 429.
        body = {"model": "demo", "prompt": prompt, "n": 8, "max_tokens": 300,
                "ignore_eos": True}  # fmt: skip
        with _in_flight(limited, ATTACKER, body):
            resp = attacker.post("/v1/completions", json=body)
            assert resp.status_code == 429 and "tokens in flight" in resp.json()["error"]["message"]


def test_a_batch_refused_midway_leaves_none_of_its_prompts_running(limited):
    # Three prompts of n=8 each: the third would be the client's 24th sequence. The first two
    # were queued before the third was refused; they are aborted, not left running for nobody.
    body = {"model": "demo", "prompt": ["a b c", "d e f", "g h i"], "n": 8, "max_tokens": 200,
            "ignore_eos": True}  # fmt: skip
    before = _aborted(limited)
    with _client(limited, ATTACKER) as attacker:
        resp = attacker.post("/v1/completions", json=body)
        assert resp.status_code == 400  # 24 sequences: more than the client may hold at all
        deadline = time.monotonic() + 60
        while _aborted(limited) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _aborted(limited) >= before + 2
        # And they no longer count: the client may have 16 sequences in flight again.
        resp = attacker.post("/v1/completions", json={**body, "prompt": "j k", "max_tokens": 2})
        assert resp.status_code == 200

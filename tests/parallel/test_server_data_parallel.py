"""A real `conveyor serve --data-parallel-size 2` (two engine processes, one core each) driven
by the official `openai` SDK: requests spread over both replicas with the same greedy text as
one engine, a disconnect aborts on the replica that holds the request (issue 17, part 3); a
replica whose engine is SIGKILLed under concurrent streams fails only its own requests while
the other's complete, and is restarted and serves again; one death past
--max-replica-restarts ends the server with exit status 1 (issue 27, item 8). A replica that
misses its heartbeat (SIGSTOP) is killed and restarted like a dead one, and its replacement
beats too (issue 27, item 7)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time

import httpx
import openai
import pytest
from tests.serve_process import metric_value, start_server

from conveyor import LLM, SamplingParams

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

PROMPTS = [f"Request {i}: the quick brown fox {'jumps ' * (i % 5)}" for i in range(32)]
MAX_TOKENS = 8


MODEL = "dp"
STALL_S = 3.0
LONG = {"prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    """One server for the module (the last test kills one of its replicas)."""
    args = ["--model", str(demo_model_dir), "--served-model-name", MODEL]
    # Blocks enough that 20 streams of STREAM_TOKENS on one replica never preempt.
    args += ["--data-parallel-size", "2", "--num-kv-blocks", "2048"]
    args += ["--engine-stall-timeout", str(STALL_S), "--max-replica-restarts", "1"]
    # The stopped-replica test is about progress: liveness would kill the stopped replica.
    args += ["--engine-heartbeat-timeout", "120"]
    proc = start_server(args, tmp_path_factory.mktemp("serve-dp"))
    yield proc
    proc.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def greedy(demo_model_dir) -> list[str]:
    """What one engine (LLM.generate) makes of PROMPTS, greedy."""
    llm = LLM(str(demo_model_dir), num_kv_blocks=128)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _metrics(server) -> str:
    return httpx.get(f"{server.base_url}/metrics").text


def _per_replica(text: str, name: str, **labels: str) -> list[float]:
    return [metric_value(text, name, replica=r, **labels) for r in ("0", "1", "all")]


def test_32_requests_spread_over_both_replicas_with_one_engines_greedy_text(server, greedy) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    success = "conveyor:request_success_total"
    before = _per_replica(_metrics(server), success, finished_reason="length")

    async def one(prompt: str) -> str:
        resp = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert resp.choices[0].finish_reason == "length"
        return resp.choices[0].text

    async def all_of_them() -> list[str]:
        async with client:
            return await asyncio.gather(*(one(p) for p in PROMPTS))

    assert asyncio.run(all_of_them()) == greedy
    text = _metrics(server)
    after = _per_replica(text, success, finished_reason="length")
    done = [a - b for a, b in zip(after, before, strict=True)]
    # Equal requests sent at once alternate between the two (equal outstanding tokens).
    assert done[0] >= 8 and done[1] >= 8, done
    assert done[0] + done[1] == done[2] == 32
    tokens = _per_replica(text, "conveyor:generation_tokens_total")
    assert tokens[0] > 0 and tokens[1] > 0 and tokens[0] + tokens[1] == tokens[2]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_disconnect_aborts_the_request_on_the_replica_that_holds_it(server) -> None:
    body = LONG
    abort = {"finished_reason": "abort"}
    aborts_before = _per_replica(_metrics(server), "conveyor:request_success_total", **abort)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as resp:
        lines = (line for line in resp.iter_lines() if line)
        assert next(lines).startswith("data: {")
        running = _per_replica(_metrics(server), "conveyor:num_requests_running")
    assert running[2] == 1 and sorted(running[:2]) == [0, 1], running
    holder = running.index(1)
    deadline = time.monotonic() + 20
    while True:  # the stream closed: the server aborts the request on its replica
        text = _metrics(server)
        aborts = _per_replica(text, "conveyor:request_success_total", **abort)
        if aborts[2] > aborts_before[2]:
            break
        assert time.monotonic() < deadline, "the abort never reached an engine"
        time.sleep(0.1)
    assert aborts[holder] == aborts_before[holder] + 1
    assert aborts[1 - holder] == aborts_before[1 - holder]
    assert _per_replica(text, "conveyor:num_requests_running") == [0, 0, 0]


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _replica_pids(server) -> dict[int, int]:
    found = re.findall(r"Data-parallel replica (\d): engine process pid (\d+)", server.log())
    pids = {int(replica): int(pid) for replica, pid in found}
    assert sorted(pids) == [0, 1], server.log()
    return pids


def _wait_health(server, status: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{server.base_url}/health", timeout=5).status_code != status:
        assert time.monotonic() < deadline, f"/health never answered {status}"
        time.sleep(0.1)


def test_a_stopped_replica_is_hung_its_stream_ends_and_health_is_503(server) -> None:
    pids = _replica_pids(server)
    url = server.base_url
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as resp:
        lines = (line for line in resp.iter_lines() if line)
        assert next(lines).startswith("data: {")
        running = _per_replica(_metrics(server), "conveyor:num_requests_running")
        holder = running.index(1)
        os.kill(pids[holder], signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            rest = list(lines)  # the other replica steps on: only this one is hung
            waited = time.monotonic() - stopped
            assert rest[-1] == "data: [DONE]" and "hung" in rest[-2], rest[-2:]
            assert STALL_S - 0.5 < waited < STALL_S + 5, waited
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and "hung" in health.json()["error"]["message"]
        finally:
            os.kill(pids[holder], signal.SIGCONT)
    _wait_health(server, 200)  # it steps again (the abort of its request): healthy
    again = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
    assert f"(data-parallel replica {holder})" in server.log()


STREAMS = 40  # as in the issue
STREAM_TOKENS = 1000  # long enough that replica 0's streams still run when it is killed


def _health(server) -> tuple[int, dict]:
    resp = httpx.get(f"{server.base_url}/health", timeout=5)
    return resp.status_code, resp.json()


def test_a_killed_replica_fails_only_its_requests_and_is_restarted(server) -> None:
    """Before: SIGKILL of one replica's engine ended every stream and the server exited."""
    pids = _replica_pids(server)
    restarts = "conveyor:replica_restarts_total"
    assert [metric_value(_metrics(server), restarts, replica=r) for r in "01"] == [0, 0]
    assert _health(server) == (200, {"replicas": 2, "serving": 2})
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    long = {"ignore_eos": True}

    async def blocking() -> tuple[int, dict]:
        # Non-streaming, sent first to idle replicas: it goes to replica 0 (ties go low).
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"model": MODEL, "prompt": "go", "max_tokens": 2000, **long}
            resp = await http.post(f"{server.base_url}/v1/completions", json=body)
            return resp.status_code, resp.json()

    async def stream(first: asyncio.Queue) -> tuple[str, str | None]:
        chunks = await client.completions.create(
            model=MODEL, prompt="go", max_tokens=STREAM_TOKENS, stream=True, extra_body=long
        )
        finish, signalled = None, False
        try:
            async for chunk in chunks:
                if not signalled:
                    signalled = True
                    first.put_nowait(None)
                finish = chunk.choices[0].finish_reason or finish
        except openai.APIError as exc:
            return "error", str(exc)
        return "done", finish

    async def scenario() -> tuple[list[float], tuple[int, dict], list[tuple[str, str | None]]]:
        async with client:
            blocked = asyncio.create_task(blocking())
            while (
                _per_replica(
                    await asyncio.to_thread(_metrics, server), "conveyor:num_requests_running"
                )[0]
                < 1
            ):
                await asyncio.sleep(0.05)
            first: asyncio.Queue = asyncio.Queue()
            streams = [asyncio.create_task(stream(first)) for _ in range(STREAMS)]
            for _ in range(STREAMS):  # every stream has its first token: all are running
                await asyncio.wait_for(first.get(), 120)
            text = await asyncio.to_thread(_metrics, server)
            held = [  # what each replica holds (running or, if ever preempted, waiting)
                r + w
                for r, w in zip(
                    _per_replica(text, "conveyor:num_requests_running"),
                    _per_replica(text, "conveyor:num_requests_waiting"),
                    strict=True,
                )
            ]
            os.kill(pids[0], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*streams), 300)
            return held, await asyncio.wait_for(blocked, 60), results

    held, (status, body), results = asyncio.run(scenario())
    # What each replica held when replica 0 was killed. A stream may end before that snapshot
    # (or between it and the kill) on a slow machine: it is done, whichever replica ran it.
    on_killed = int(held[0]) - 1  # replica 0 held the non-streaming request too
    assert on_killed >= 1 and held[1] >= 1, held  # both replicas held streams
    done = [r for r in results if r[0] == "done"]
    failed = [r for r in results if r[0] == "error"]
    assert len(done) + len(failed) == STREAMS
    # The other replica's streams ran to their end; only the killed one's ended early.
    assert 1 <= len(failed) <= on_killed and len(done) >= held[1], (held, results)
    assert all(finish == "length" for _, finish in done), done
    assert all("Data-parallel replica 0 failed and is restarting" in m for _, m in failed)
    assert status == 503 and body["error"]["type"] == "ServiceUnavailableError", body
    assert "replica 0" in body["error"]["message"]
    code, health = _health(server)  # replica 1 serves on, whatever replica 0's state
    assert code == 200 and health["replicas"] == 2 and health["serving"] in (1, 2), health
    deadline = time.monotonic() + 180
    while _health(server)[1]["serving"] != 2:
        assert time.monotonic() < deadline, f"replica 0 never came back:\n{server.log()}"
        time.sleep(0.2)
    new_pids = _replica_pids(server)
    assert new_pids[0] != pids[0] and new_pids[1] == pids[1]
    assert _running(new_pids[0]) and not _running(pids[0])
    text = _metrics(server)
    assert [metric_value(text, restarts, replica=r) for r in "01"] == [1, 0]
    # The restarted replica serves: concurrent requests spread over both again.
    success = "conveyor:request_success_total"
    before = _per_replica(text, success, finished_reason="length")

    async def short() -> str:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="x", max_retries=0
        ) as c:
            resps = await asyncio.gather(*(
                c.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=8, extra_body=long)
                for i in range(8)
            ))  # fmt: skip
            return [r.choices[0].finish_reason for r in resps]

    assert asyncio.run(short()) == ["length"] * 8
    after = _per_replica(_metrics(server), success, finished_reason="length")
    assert after[0] > before[0] and after[1] > before[1], (before, after)
    head = httpx.head(f"{server.base_url}/health")
    assert head.status_code == 200 and head.content == b""
    assert "Data-parallel replica 0 died" in server.log()


# Last in the module: it ends the shared server.
def test_a_death_past_max_replica_restarts_ends_the_server_with_exit_status_1(server) -> None:
    try:
        _wait_health(server, 200, timeout_s=180)  # both replicas serve again
        assert _health(server)[1]["serving"] == 2, _health(server)
        pids = _replica_pids(server)  # replica 0 was restarted once: the limit
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        assert server.proc.wait(timeout=30) == 1
        assert time.monotonic() - killed < 15
        # The surviving replica was stopped too: no orphan engine is left behind.
        deadline = time.monotonic() + 10
        while _running(pids[1]):
            assert time.monotonic() < deadline, "replica 1 outlived the server"
            time.sleep(0.1)
    finally:
        server.stop(signal.SIGKILL)
    log = server.log()
    assert "Data-parallel replica 0 died after 1 restart(s) (--max-replica-restarts 1)" in log
    assert "The engine died; stopping the server with exit status 1" in log


def test_a_replica_that_misses_its_heartbeat_is_restarted_and_so_is_watched_again(
    demo_model_dir, tmp_path
) -> None:
    """Before: a stopped replica was never noticed while it held no request."""
    args = ["--model", str(demo_model_dir), "--data-parallel-size", "2"]
    args += ["--num-kv-blocks", "128", "--max-replica-restarts", "1"]
    server = start_server([*args, "--engine-heartbeat-timeout", "3"], tmp_path)
    stopped: list[int] = []
    try:
        pids = _replica_pids(server)
        os.kill(pids[0], signal.SIGSTOP)
        stopped.append(pids[0])
        deadline = time.monotonic() + 180
        while _replica_pids(server)[0] == pids[0] or _health(server)[1]["serving"] != 2:
            assert time.monotonic() < deadline, f"replica 0 never came back:\n{server.log()}"
            time.sleep(0.2)
        assert not _running(pids[0])  # killed, though it was only stopped
        body = {"prompt": "x", "max_tokens": 2}
        resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
        # The replacement is watched too: stopped, it is the death past the restart limit.
        replacement = _replica_pids(server)[0]
        os.kill(replacement, signal.SIGSTOP)
        stopped.append(replacement)
        assert server.proc.wait(timeout=60) == 1
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        server.stop(signal.SIGKILL)
    log = server.log()
    for pid in stopped:
        assert f"(pid {pid}) sent nothing for 3 s, not even its heartbeat" in log, log
    assert "Data-parallel replica 0 died after 1 restart(s)" in log

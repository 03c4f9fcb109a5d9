"""AsyncLLM in-process: deltas, aborts, a failing step, a dead engine, the shutdown grace."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conveyor import LLM, AsyncLLM, SamplingParams
from conveyor.entrypoints.async_llm import EngineNotRunningError, RequestFailedError
from conveyor.server.app import build_app

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(path, **kwargs) -> AsyncLLM:
    return AsyncLLM(str(path), num_kv_blocks=64, log_stats_interval_s=0, **kwargs)


async def _collect(stream) -> tuple[str, list[int], str | None]:
    text, ids, finish = "", [], None
    async for out in stream:
        text += out.outputs[0].text
        ids += out.outputs[0].token_ids
        finish = out.outputs[0].finish_reason
    return text, ids, finish


async def _until_idle(llm: AsyncLLM) -> None:
    for _ in range(200):
        if not llm.engine.has_unfinished_requests() and llm.engine.scheduler.kv_usage == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not become idle")


def test_concurrent_deltas_concatenate_to_llm_generate(demo_model_dir) -> None:
    prompts = ["One", "Two three", "Four five six", "Seven"]
    expected = LLM(str(demo_model_dir), num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)

    async def run():
        llm = _engine(demo_model_dir)
        results = await asyncio.gather(*(_collect(llm.generate(p, GREEDY)) for p in prompts))
        await llm.shutdown()
        return results

    for (text, ids, finish), out in zip(asyncio.run(run()), expected, strict=True):
        assert (text, ids, finish) == (out.outputs[0].text, out.outputs[0].token_ids, "length")


def test_abort_and_leaving_early_both_free_the_blocks(demo_model_dir) -> None:
    long = SamplingParams(max_tokens=500, ignore_eos=True)

    async def run():
        llm = _engine(demo_model_dir)
        stream = llm.generate("abort me", long, request_id="a")
        outputs = []
        async for out in stream:
            outputs.append(out)
            if len(outputs) == 2:
                await llm.abort("a")
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        await _until_idle(llm)

        stream = llm.generate("leave me", long)
        async for _ in stream:
            break  # the consumer goes away
        await stream.aclose()
        await _until_idle(llm)
        with pytest.raises(ValueError, match="empty"):
            llm.generate([], long)
        await llm.shutdown()

    asyncio.run(run())


def test_a_failing_step_fails_its_requests_and_the_rest_go_on(demo_model_dir) -> None:
    async def run():
        llm = _engine(demo_model_dir, max_num_seqs=1)  # B waits while A runs
        execute = llm.engine.runner.execute
        calls = 0

        def flaky(sched_out):
            nonlocal calls
            calls += 1
            if calls == 3:
                raise RuntimeError("boom")
            return execute(sched_out)

        llm.engine.runner.execute = flaky
        a = asyncio.ensure_future(_collect(llm.generate("A", GREEDY)))
        b = asyncio.ensure_future(_collect(llm.generate("B", GREEDY)))
        with pytest.raises(RequestFailedError, match="RuntimeError"):
            await a
        _, ids, finish = await b
        assert len(ids) == 10 and finish == "length"
        llm.check_health()  # still healthy
        assert await _collect(llm.generate("C", GREEDY)) is not None
        await _until_idle(llm)
        await llm.shutdown()

    asyncio.run(run())


def test_dead_engine_answers_503_on_health_and_requests(demo_model_dir) -> None:
    async def run():
        llm = _engine(demo_model_dir)
        app = build_app(llm)
        await llm.start()

        def broken(*_):
            raise RuntimeError("broken beyond repair")

        llm.engine.step = broken
        llm.engine.abort_step = broken  # recovery fails too: the loop dies
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/health")).status_code == 200
            with pytest.raises(EngineNotRunningError):
                await _collect(llm.generate("x", GREEDY))
            health = await client.get("/health")
            assert health.status_code == 503
            assert health.json()["error"]["type"] == "ServiceUnavailableError"
            resp = await client.post("/v1/completions", json={"prompt": "x"})
            assert resp.status_code == 503 and "failed" in resp.json()["error"]["message"]
        await llm.shutdown()

    asyncio.run(run())


def test_shutdown_grace_then_abort_and_no_new_requests(demo_model_dir) -> None:
    async def run():
        llm = _engine(demo_model_dir)
        short = llm.generate("short", GREEDY)
        long = llm.generate("long", SamplingParams(max_tokens=1000, ignore_eos=True))
        first = await long.__anext__()
        llm.begin_shutdown(0.3)
        with pytest.raises(EngineNotRunningError, match="shutting down"):
            llm.generate("late", GREEDY)
        assert (await _collect(short))[2] == "length"  # in-flight work finishes
        rest = await _collect(long)
        assert rest[2] == "abort" and 1 + len(rest[1]) < 1000
        assert first.outputs[0].finish_reason is None
        await llm.shutdown()

    asyncio.run(run())


def test_a_failing_step_gives_500_or_an_sse_error_event(demo_model_dir) -> None:
    async def run():
        llm = _engine(demo_model_dir)
        app = build_app(llm)
        await llm.start()
        execute = llm.engine.runner.execute
        fail = True

        def flaky(sched_out):
            if fail:
                raise RuntimeError("kernel fault")
            return execute(sched_out)

        llm.engine.runner.execute = flaky
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"prompt": "x", "max_tokens": 4}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 500
            error = resp.json()["error"]
            assert error["type"] == "InternalServerError" and "RuntimeError" in error["message"]
            assert "kernel fault" not in error["message"]  # internals stay in the server log
            resp = await client.post("/v1/completions", json={**body, "stream": True})
            assert resp.status_code == 200
            events = resp.text.split("\n\n")
            assert json.loads(events[-3].removeprefix("data: "))["error"]["code"] == 500
            assert events[-2:] == ["data: [DONE]", ""]
            fail = False
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200 and (await client.get("/health")).status_code == 200
        await llm.shutdown()

    asyncio.run(run())


def test_stats_log_line_reports_throughput_while_busy(caplog) -> None:
    from conveyor.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from conveyor.entrypoints.metrics import EngineMetrics

    metrics = EngineMetrics("m", log_interval_s=0.001)
    out = RequestOutput(
        "r", "p", [1, 2], [CompletionOutput(0, "ab", [5, 6])], metrics=RequestMetrics(0.0)
    )
    assert metrics.record_output(out, 2, None, now=1.0) == 1.0
    metrics.record_step(
        2, num_running=1, num_waiting=3, kv_usage=0.25, num_preemptions=0, step_time_s=2.0,
        prefix_cache_queries=64, prefix_cache_hits=16,
    )  # fmt: skip
    with caplog.at_level("INFO", logger="conveyor.stats"):
        metrics.maybe_log(metrics._last_log + 2.0)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "prompt throughput: 1.0 tokens/s" in line and "generation throughput: 1.0" in line
    assert "Running: 1 reqs, Waiting: 3 reqs, KV cache usage: 25.0%" in line
    assert "Prefix cache hit rate: 25.0%" in line  # of this interval's lookups (tokens)
    text = metrics.render().decode()
    assert 'conveyor:prefix_cache_queries_total{model_name="m"} 64.0' in text
    assert 'conveyor:prefix_cache_hits_total{model_name="m"} 16.0' in text


def test_stats_log_line_rates_are_over_busy_time_and_idle_intervals_log_nothing(caplog) -> None:
    from conveyor.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from conveyor.entrypoints.metrics import EngineMetrics

    now = [100.0]
    metrics = EngineMetrics("m", log_interval_s=5.0, clock=lambda: now[0])
    last = None
    with caplog.at_level("INFO", logger="conveyor.stats"):
        # A burst: 10 steps of 0.05 s, 10 new tokens each, for one request of 20 prompt tokens.
        for i in range(10):
            now[0] += 0.05
            delta = CompletionOutput(0, "x" * 10, list(range(10)))
            out = RequestOutput("r", "p", list(range(20)), [delta], finished=i == 9)
            out.metrics = RequestMetrics(100.0)
            last = metrics.record_output(out, 20, last, now[0])
            running = int(i < 9)
            metrics.record_step(10, running, 0, 0.1 * running, 0, step_time_s=0.05)
            metrics.maybe_log(now[0])
        assert not caplog.records  # 0.5 s: the interval is not over
        metrics.maybe_log(130.5)  # after 30 s idle: the burst's rate, not 100 tokens / 30.5 s
        metrics.maybe_log(140.0)  # an interval in which nothing ran: no line
    (line,) = [r.getMessage() for r in caplog.records]
    assert "prompt throughput: 40.0 tokens/s" in line
    assert "generation throughput: 200.0 tokens/s" in line
    assert "Running: 0 reqs, Waiting: 0 reqs" in line and "Engine busy: 0.50 s of 30.5 s" in line

    caplog.clear()
    metrics.record_step(0, 0, 3, 0.0, 0)  # requests wait but no step runs: shown, at 0 tokens/s
    with caplog.at_level("INFO", logger="conveyor.stats"):
        metrics.maybe_log(146.0)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "generation throughput: 0.0 tokens/s" in line and "Waiting: 3 reqs" in line
    assert "Engine busy: 0.00 s of 6.0 s" in line


def test_engine_thread_reports_how_long_each_step_ran(demo_model_dir) -> None:
    import threading

    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.entrypoints.engine_thread import EngineThread

    stats, errors, done = [], [], threading.Event()

    def emit(outputs, step_stats) -> None:
        stats.append(step_stats)
        if any(o.finished for o in outputs):
            done.set()

    engine = LLMEngine(EngineConfig(model=str(demo_model_dir), num_kv_blocks=64))
    thread = EngineThread(
        engine, emit=emit, reject=lambda _, e: errors.append(e), on_dead=errors.append
    )
    thread.start()
    ids = engine.tokenizer.encode("Hello there")
    thread.add("r", "Hello there", ids, GREEDY, arrival_time=0.0)
    assert done.wait(60)
    thread.stop()
    assert not errors
    stepped = [s for s in stats if s.num_tokens]
    assert sum(s.num_tokens for s in stepped) == len(ids) + GREEDY.max_tokens - 1
    assert all(s.step_time_s > 0 for s in stepped)
    assert stats[-1].num_tokens == 0 and stats[-1].step_time_s == 0.0  # the stop's emit


def _record_step_threads(monkeypatch) -> set[int]:
    """Patch LLMEngine.step to note the thread each step runs in."""
    import threading

    from conveyor.engine.llm_engine import LLMEngine

    threads: set[int] = set()
    step = LLMEngine.step

    def recording_step(self):
        threads.add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", recording_step)
    return threads


def test_a_built_engine_thread_steps_in_the_thread_that_built_the_engine(
    demo_model_dir, monkeypatch
) -> None:
    """libgomp gives every thread that runs parallel regions its own pool of workers; a
    second pool makes it throttle the workers' spinning (engine_thread.py's docstring), so
    the weights' loading and the steps share one thread."""
    import threading

    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.entrypoints.engine_thread import EngineThread

    step_threads = _record_step_threads(monkeypatch)
    built_in, done, errors = [], threading.Event(), []

    def factory() -> LLMEngine:
        built_in.append(threading.get_ident())
        return LLMEngine(EngineConfig(model=str(demo_model_dir), num_kv_blocks=64))

    def emit(outputs, _stats) -> None:
        if any(o.finished for o in outputs):
            done.set()

    thread = EngineThread.build(
        factory, emit=emit, reject=lambda _, e: errors.append(e), on_dead=errors.append
    )
    assert built_in and built_in[0] != threading.get_ident()
    assert not thread.started  # built, waiting for start()
    thread.start()
    ids = thread.engine.tokenizer.encode("Hello there")
    thread.add("r", "Hello there", ids, GREEDY, arrival_time=0.0)
    assert done.wait(60)
    thread.stop()
    assert not errors and step_threads == set(built_in)


def test_a_built_engine_thread_raises_what_building_raised_and_stops_unstarted(
    demo_model_dir,
) -> None:
    from conveyor.config import EngineConfig
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.entrypoints.engine_thread import EngineThread

    callbacks = dict(emit=lambda *_: None, reject=lambda *_: None, on_dead=lambda _: None)

    def broken() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        EngineThread.build(broken, **callbacks)
    config = EngineConfig(model=str(demo_model_dir), num_kv_blocks=64)
    thread = EngineThread.build(lambda: LLMEngine(config), **callbacks)
    thread.stop(timeout_s=30)  # never started: its thread ends without a step
    assert not thread._thread.is_alive()


def test_the_engine_process_steps_in_the_thread_that_built_the_engine(
    demo_model_dir, monkeypatch
) -> None:
    """run_engine_process (the engine process's body) builds the engine and steps it in the
    thread that calls it; commands arrive on another."""
    import threading
    from multiprocessing import Pipe

    from conveyor.config import EngineConfig
    from conveyor.entrypoints.engine_child import run_engine_process
    from conveyor.entrypoints.wire import unpack_output

    step_threads = _record_step_threads(monkeypatch)
    commands_out, commands_in = Pipe(duplex=False)
    outbox_out, outbox_in = Pipe(duplex=False)
    config = EngineConfig(model=str(demo_model_dir), num_kv_blocks=64)
    body = threading.Thread(target=run_engine_process, args=(config, commands_out, outbox_in))
    body.start()
    message = outbox_out.recv()
    assert message[0] == "ready", message
    commands_in.send(("add", "r", [1, 2, 3], [1, 2, 3], GREEDY, 0.0))
    finished = False
    while not finished:
        assert outbox_out.poll(60)
        message = outbox_out.recv()
        if message[0] == "step":
            finished = any(unpack_output(o).finished for o in message[1])
    commands_in.send(("stop", "done"))
    body.join(60)
    assert not body.is_alive() and step_threads == {body.ident}

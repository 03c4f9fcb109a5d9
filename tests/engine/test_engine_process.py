"""AsyncLLM with its engine in a child process: same outputs, and no process left behind.

Each case starts a real engine process (a fresh interpreter that loads the demo model), so
the cases are few: parity with LLM.generate (prompt fields, n > 1, an abort), an engine that
cannot start, an engine process that dies under load, and an engine process whose server
process died. The outputs' wire format is checked on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from conveyor import LLM, AsyncLLM, SamplingParams
from conveyor.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from conveyor.entrypoints.async_llm import EngineNotRunningError
from conveyor.entrypoints.wire import pack_output, unpack_output

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(path, **kwargs) -> AsyncLLM:
    return AsyncLLM(
        str(path), num_kv_blocks=64, log_stats_interval_s=0, engine_process=True, **kwargs
    )


async def _collect(stream) -> tuple[str | None, list[int], list[tuple[int, str, list[int]]]]:
    """The prompt fields of the last output, and (index, text, ids) per sample."""
    samples: dict[int, tuple[str, list[int], str | None]] = {}
    async for out in stream:
        for c in out.outputs:
            text, ids, _ = samples.get(c.index, ("", [], None))
            samples[c.index] = (text + c.text, ids + c.token_ids, c.finish_reason)
    return out.prompt, out.prompt_token_ids, sorted(samples.items())


async def _until_idle(llm: AsyncLLM) -> None:
    for _ in range(500):
        stats = llm._core.last_stats
        idle = stats and stats.kv_usage == 0 and stats.num_running == stats.num_waiting == 0
        if idle and not llm.num_unfinished_requests:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine process did not report itself idle")


def test_engine_process_gives_llm_generate_outputs(demo_model_dir) -> None:
    prompts = ["One", "Two three", "Four five six"]
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=2, ignore_eos=True)
    llm_sync = LLM(str(demo_model_dir), num_kv_blocks=64)
    expected = llm_sync.generate(prompts, GREEDY, use_tqdm=False)
    expected_n = llm_sync.generate(["Seven"], sampled, use_tqdm=False)[0]

    async def run():
        llm = _engine(demo_model_dir)
        assert llm.engine is None and llm.max_model_len == llm_sync.llm_engine.max_model_len
        results = await asyncio.gather(*(_collect(llm.generate(p, GREEDY)) for p in prompts))
        n_result = await _collect(llm.generate("Seven", sampled))
        long = SamplingParams(max_tokens=500, ignore_eos=True)
        outputs = []
        async for out in llm.generate("abort me", long, request_id="a"):
            outputs.append(out)
            if len(outputs) == 2:
                await llm.abort("a")
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        await _until_idle(llm)
        pid = llm._core.pid
        await llm.shutdown()
        return results, n_result, pid

    results, n_result, pid = asyncio.run(run())
    for (prompt, prompt_ids, samples), out in zip(results, expected, strict=True):
        assert (prompt, prompt_ids) == (out.prompt, out.prompt_token_ids)
        ((_, (text, ids, finish)),) = samples
        assert (text, ids, finish) == (out.outputs[0].text, out.outputs[0].token_ids, "length")
    prompt, _, samples = n_result
    assert prompt == "Seven"
    assert [(t, ids) for _, (t, ids, _) in samples] == [
        (c.text, c.token_ids) for c in expected_n.outputs
    ]
    _assert_gone(pid)


def test_an_engine_that_cannot_start_raises_its_error(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        AsyncLLM(str(tmp_path), engine_process=True)


def test_a_dead_engine_process_fails_streams_and_health(demo_model_dir) -> None:
    async def run():
        llm = _engine(demo_model_dir)
        long = SamplingParams(max_tokens=500, ignore_eos=True)
        stream = llm.generate("doomed", long)
        await stream.__anext__()
        os.kill(llm._core.pid, signal.SIGKILL)
        with pytest.raises(EngineNotRunningError, match="engine process died"):
            async for _ in stream:
                pass
        with pytest.raises(EngineNotRunningError):
            llm.check_health()
        with pytest.raises(EngineNotRunningError):
            llm.generate("after", GREEDY)
        await llm.shutdown()  # nothing left to stop: returns at once

    asyncio.run(run())


def test_the_engine_process_exits_when_its_server_process_dies(demo_model_dir) -> None:
    script = (
        "import os, sys\n"
        "from conveyor import AsyncLLM\n"
        f"llm = AsyncLLM({str(demo_model_dir)!r}, num_kv_blocks=64, engine_process=True)\n"
        "print(llm._core.pid, flush=True)\n"
        "os._exit(0)\n"  # no cleanup at all, as after a crash
    )
    command = [sys.executable, "-c", script]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    _assert_gone(int(run.stdout.split()[-1]))


def _assert_gone(pid: int, timeout_s: float = 30.0) -> None:
    """The process has exited (a zombie awaiting its parent's wait counts as exited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the engine process {pid} is still running")


def test_outputs_cross_the_pipe_intact() -> None:
    logprobs = [{5: Logprob(-0.25, 1, " a"), 9: Logprob(-1.5, 2, None)}, {7: Logprob(-0.5)}]
    out = RequestOutput(
        "r",
        "the prompt",
        [1, 2],
        [
            CompletionOutput(0, " a b", [5, 7], -0.75, logprobs, "stop", "b", None),
            CompletionOutput(1, "", [], None, None, "abort", None, "deadline exceeded"),
        ],
        finished=True,
        error="failed",
        metrics=RequestMetrics(1.0, 2.0, None, 4.0),
    )
    back = unpack_output(pickle.loads(pickle.dumps(pack_output(out))))
    assert back == dataclasses.replace(out, prompt=None, prompt_token_ids=[])
    assert unpack_output(pack_output(RequestOutput("s", None, [3]))).metrics is None


def test_an_engine_process_exits_without_waiting_for_a_running_compile(demo_model_dir) -> None:
    """Issue 49 item 8: a compile cannot be stopped, and a normal exit waits for its thread
    (2,900 optional terms: minutes on the demo vocabulary). The engine process ends itself at
    once instead; before, stop() waited 30 s and killed it."""
    from conveyor.entrypoints.async_llm import RequestRejectedError
    from conveyor.structured_params import StructuredOutputsParams

    terms = " ".join(f'"{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}"?' for i in range(2900))
    slow = StructuredOutputsParams(grammar=f"root ::= {terms}")
    params = SamplingParams(max_tokens=2, structured_outputs=slow)

    async def main() -> tuple[float, int | None]:
        llm = _engine(demo_model_dir, grammar_compile_timeout=0.5)
        await llm.start()
        with pytest.raises(RequestRejectedError, match="grammar_compile_timeout"):
            await _collect(llm.generate("x", params))
        start = time.monotonic()
        await llm.shutdown()
        return time.monotonic() - start, llm._core._process.returncode

    seconds, code = asyncio.run(main())
    assert code == 0  # it exited by itself, not killed
    assert seconds < 25

"""Tensor parallelism's failures and shutdown, with real processes: a worker killed with
SIGKILL, or one that hangs, ends the engine (offline, a hung worker started by hand as on
another machine: the step raises after CONVEYOR_TP_TIMEOUT_S; served, a killed worker that
conveyor started: the server exits non-zero within a bounded time, leaving no engine process
behind), and a served model with
--tensor-parallel-size 2 answers through the openai SDK. (That a clean shutdown stops the
workers is checked in test_tensor_parallel.py.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest
import torch.distributed as dist
from tests.serve_process import ServeProcess, free_port

from conveyor import LLM, SamplingParams
from conveyor.model.distributed.group import TensorParallelError
from conveyor.server.launch import ENGINE_DIED_EXIT_CODE

pytestmark = pytest.mark.slow  # a real server, worker processes, a timeout

_WORKER_PID = re.compile(r"Tensor-parallel worker rank 1 started \(pid (\d+)\)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_a_worker_started_by_hand_joins_and_its_hang_fails_the_step_in_bounded_time(
    demo_model_dir, monkeypatch
):
    # As on a second machine: rank 0 starts no worker (CONVEYOR_TP_LOCAL_SIZE=1); rank 1 is
    # `python -m conveyor.parallel.worker` with the rendezvous in its environment.
    monkeypatch.setenv("CONVEYOR_TP_LOCAL_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("CONVEYOR_TP_TIMEOUT_S", "4")
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    worker = subprocess.Popen([sys.executable, "-m", "conveyor.parallel.worker"], env=env)
    try:
        llm = LLM(str(demo_model_dir), tensor_parallel_size=2, num_kv_blocks=16)
        assert llm.llm_engine.runner.tp_workers.procs == []  # none started here
        params = SamplingParams(temperature=0.0, max_tokens=4)
        (out,) = llm.generate([[1, 2, 3]], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
        worker.send_signal(signal.SIGSTOP)  # hung: alive, but it takes part in nothing
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="timed out"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
        # CONVEYOR_TP_TIMEOUT_S (4 s) bounds it: at least that, and well under the 60 s default
        # it would wait if the setting were ignored (generous for a loaded machine).
        assert 3.5 < time.monotonic() - start < 45
        llm.llm_engine.shutdown()
        assert not dist.is_initialized()
    finally:
        worker.kill()
        worker.wait()


def test_served_with_two_ranks_answers_then_a_killed_worker_ends_it(tmp_path, demo_model_dir):
    server = ServeProcess(
        ["--model", str(demo_model_dir), "--tensor-parallel-size", "2", "--num-kv-blocks", "64"],
        tmp_path / "serve.log",
    )
    try:
        server.wait_ready()
        log = server.log()
        worker = int(_WORKER_PID.search(log).group(1))
        engine = int(re.search(r"Engine process started \(pid (\d+)\)", log).group(1))
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="Hello, my name is", max_tokens=8)
        assert out.choices[0].text and out.usage.completion_tokens == 8
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content is not None
        # A real SIGKILL of the worker rank, with the server idle: it exits non-zero soon.
        os.kill(worker, signal.SIGKILL)
        try:  # generous for a loaded machine: without the watchdog an idle server never exits
            code = server.proc.wait(120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit after its worker died:\n{server.log()}")
        assert code == ENGINE_DIED_EXIT_CODE != 0, server.log()
        assert "tensor-parallel worker rank 1" in server.log()
        assert _wait_gone(engine, 10), "the engine process outlived the server"
    finally:
        server.stop(signal.SIGKILL)

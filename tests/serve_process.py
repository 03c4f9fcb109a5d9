"""Run a real `conveyor serve` (uvicorn) in a subprocess on 127.0.0.1 and a free port."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def conveyor_command() -> list[str]:
    """The `conveyor` console script next to this interpreter (what users run)."""
    script = Path(sys.executable).with_name("conveyor")
    if script.is_file():
        return [str(script)]
    found = shutil.which("conveyor")
    return [found] if found else [sys.executable, "-m", "conveyor.cli"]


class ServeProcess:
    """`conveyor serve ARGS --host 127.0.0.1 --port PORT`, its log in `log_path`."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [*conveyor_command(), "serve", *args, "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--log-stats-interval", "0"]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=log_path.parent,
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"conveyor serve exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"conveyor serve did not become healthy:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_server(args: list[str], tmp_dir: Path, env: dict[str, str] | None = None):
    """Start and wait until /health answers 200 (retries once if the port was taken)."""
    for attempt in range(3):
        server = ServeProcess(args, tmp_dir / f"serve-{attempt}.log", env)
        try:
            server.wait_ready()
            return server
        except RuntimeError:
            server.stop(signal.SIGKILL)
            if not re.search(r"already in use", server.log(), re.I):
                raise
    raise RuntimeError("no free port found for conveyor serve")


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one series in Prometheus text (0.0 if it is absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        series, value = line.rsplit(" ", 1)
        found = dict(re.findall(r'(\w+)="([^"]*)"', series[len(name) :]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(value)
    return 0.0


# Makes every step of an engine process that has this environment burn CPU in torch ops (which
# release the GIL, as the model's do) for CONVEYOR_TEST_SLOW_STEP_S seconds first.
_SLOW_STEP = textwrap.dedent(
    """
    import os
    if os.environ.get("CONVEYOR_TEST_SLOW_STEP_S"):
        import time
        import conveyor
        import torch
        from conveyor.engine.llm_engine import LLMEngine

        _seconds, _step = float(os.environ["CONVEYOR_TEST_SLOW_STEP_S"]), LLMEngine.step

        def _slow_step(self):
            a, end = torch.ones(256, 256), time.monotonic() + _seconds
            while time.monotonic() < end:
                a = (a @ a).clamp_(-1, 1)
            return _step(self)

        LLMEngine.step = _slow_step
    """
)


# Holds a stage of a request for as long as a test needs, so that a signal finds it there:
#   CONVEYOR_TEST_HOLD_GRAMMAR_WORKER  the grammar worker process never gets ready (its start
#                                      is what a request's first grammar check waits for)
#   CONVEYOR_TEST_HOLD_RENDER          every chat template render of `conveyor serve` waits
#                                      until its request is cancelled, logging a line first
_HOLDS = textwrap.dedent(
    """
    import os
    import sys
    if os.environ.get("CONVEYOR_TEST_HOLD_GRAMMAR_WORKER") and (
        "conveyor.structured.grammar_worker" in sys.orig_argv
    ):
        while os.read(0, 1 << 16):  # its init frame, never answered, until the server goes
            pass
        os._exit(0)
    if os.environ.get("CONVEYOR_TEST_HOLD_RENDER") and "serve" in sys.orig_argv:
        import asyncio
        from conveyor.server.context import ServingContext

        async def _held_render(self, *args, **kwargs):
            print("test hook: a chat template render is held", file=sys.stderr, flush=True)
            await asyncio.Event().wait()

        ServingContext.render_chat = _held_render
    """
)


def _hooks_env(tmp_path: Path, **env: str) -> dict[str, str]:
    """The environment that runs this module's hooks (those `env` turns on) in every Python
    process of the server."""
    (tmp_path / "sitecustomize.py").write_text(_SLOW_STEP + _HOLDS)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, **env}


def slow_step_env(tmp_path: Path, seconds: float) -> dict[str, str]:
    """The environment that makes an engine process's steps take `seconds` each."""
    return _hooks_env(tmp_path, CONVEYOR_TEST_SLOW_STEP_S=str(seconds))


def held_grammar_worker_env(tmp_path: Path) -> dict[str, str]:
    """The environment in which the server's grammar worker never gets ready."""
    return _hooks_env(tmp_path, CONVEYOR_TEST_HOLD_GRAMMAR_WORKER="1")


def held_render_env(tmp_path: Path) -> dict[str, str]:
    """The environment in which the server's chat template renders never end."""
    return _hooks_env(tmp_path, CONVEYOR_TEST_HOLD_RENDER="1")


@contextmanager
def serve_folder(
    model: Path, tmp: Path, name: str, num_kv_blocks: int = 128, max_model_len: int = 1024
) -> Iterator[ServeProcess]:
    """`conveyor serve` of the checkpoint `model` as `name`, its log in `tmp`, which is
    removed afterwards."""
    args = ["--model", str(model), "--num-kv-blocks", str(num_kv_blocks),
            "--max-model-len", str(max_model_len)]  # fmt: skip
    proc = ServeProcess([*args, "--served-model-name", name], tmp / "serve.log")
    try:
        proc.wait_ready(timeout=240)
        yield proc
    finally:
        proc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def answer_to_sigterm(
    server: ServeProcess, path: str, body: dict, reached: Callable[[], bool]
) -> httpx.Response:
    """POST `body` to `path`, SIGTERM the server once `reached()` says the request got to the
    stage under test (polled; failing if the request ended first), and return its answer
    after the server exited 0."""
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{server.base_url}{path}", json=body, timeout=120)
        deadline = time.monotonic() + 120  # far above what any machine needs
        while not reached():
            assert not pending.done(), pending.result().text
            assert time.monotonic() < deadline, "the request never got there"
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        answer = pending.result()
    assert server.proc.wait(timeout=60) == 0
    return answer

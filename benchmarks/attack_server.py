"""`conveyor serve` for the attack benchmarks (grammar, prefill and connection attacks): on a
free port of 127.0.0.1, returned once /health answers.

The benchmarks run as scripts (`python benchmarks/x.py`, this folder first on sys.path) and
are loaded by file in their tests; both find this module through `import attack_server`
after `sys.path` holds this folder.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def conveyor_command() -> list[str]:
    """The `conveyor` console script beside this interpreter, else `python -m conveyor.cli`."""
    script = Path(sys.executable).with_name("conveyor")
    found = str(script) if script.is_file() else shutil.which("conveyor")
    return [found] if found else [sys.executable, "-m", "conveyor.cli"]


def start_server(
    args: list[str], model: str | None = None, src: str | None = None, timeout_s: float = 300
) -> tuple[subprocess.Popen, str]:
    """`conveyor serve ARGS` (quiet logs, served as "demo") on a free port.

    Args:
        args: more flags.
        model: --model (None: the demo model).
        src: another checkout's src/ folder to serve from (PYTHONPATH), for a before/after.
    Returns:
        The process and its base URL.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [*conveyor_command(), "serve", "--port", str(port), "--log-level", "warning",
               "--log-stats-interval", "0", "--served-model-name", "demo", *args]  # fmt: skip
    if model:
        command += ["--model", model]
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + timeout_s
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

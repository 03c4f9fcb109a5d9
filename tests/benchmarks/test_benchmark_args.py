"""Benchmark flags: a plot without matplotlib stops a benchmark before it runs, and `--model`
is a checkpoint folder everywhere while `--served-model-name` is the name requests send."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.cli import main as cli_main

pytestmark = pytest.mark.slow  # runs a benchmark script

ROOT = Path(__file__).resolve().parents[2]
MISSING = "needs matplotlib, which is not installed: pip install -e '.[bench]'"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _without_matplotlib(run: str, argv: list[str]) -> subprocess.CompletedProcess:
    """Run `run` (Python) with matplotlib unimportable and sys.argv = argv."""
    code = f"import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = {argv!r}; {run}"
    # The timeout only bounds a regression (the benchmark running); success takes seconds.
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("target", ["scheduling", "serve", "bench serve"])
def test_a_plot_without_matplotlib_stops_the_benchmark_before_it_runs(target, tmp_path) -> None:
    out = tmp_path / "out"
    if target == "scheduling":
        script = str(ROOT / "benchmarks" / "scheduling.py")
        run, argv = f"runpy.run_path({script!r}, run_name='__main__')", [script]
        argv += ["--out-dir", str(out), "--num-requests", "4", "--sim-requests", "10"]
        message = f"benchmarks/scheduling.py writes plots and {MISSING}"
    elif target == "serve":  # plots by default; --model would make the server fail to start
        script = str(ROOT / "benchmarks" / "serve.py")
        run, argv = f"runpy.run_path({script!r}, run_name='__main__')", [script]
        argv += ["--model", str(tmp_path / "missing"), "--result-json", str(out / "r.json")]
        message = f"--plot {MISSING}"
    else:  # nothing listens there: without the check it would fail on connecting
        run = "runpy.run_module('conveyor.cli', run_name='__main__', alter_sys=True)"
        argv = ["conveyor", "bench", "serve", "--base-url", f"http://127.0.0.1:{_closed_port()}"]
        argv += ["--num-prompts", "2", "--plot", str(out / "p.png")]
        message = f"--plot {MISSING}"
    proc = _without_matplotlib(run, argv)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == message
    assert "Traceback" not in proc.stderr
    assert not out.exists()  # nothing was written: the benchmark never started


def test_bench_serve_sends_served_model_name_and_has_no_model_flag(capsys) -> None:
    from conveyor.cli import build_parser

    argv = ["bench", "serve", "--served-model-name", "qwen"]
    assert build_parser().parse_args(argv).served_model_name == "qwen"
    assert build_parser().parse_args(["bench", "serve"]).served_model_name is None
    # --model is a checkpoint folder (as in `conveyor serve`); it never names a served model.
    assert cli_main(["bench", "serve", "--model", "qwen"]) == 2
    assert "unrecognized arguments: --model qwen" in capsys.readouterr().err


def test_serve_benchmark_model_is_a_folder_and_served_name_reaches_the_server() -> None:
    serve = _load("serve.py")
    args = serve.build_parser().parse_args(["--model", "/ckpt/qwen", "--served-model-name", "q"])
    assert (args.model, args.served_model_name) == ("/ckpt/qwen", "q")
    command = serve.server_command(args, 1234)
    assert command[command.index("--model") + 1] == "/ckpt/qwen"
    assert command[command.index("--served-model-name") + 1] == "q"
    assert command[command.index("--port") + 1] == "1234"
    default = serve.server_command(serve.build_parser().parse_args([]), 1234)
    assert "--model" not in default and "--served-model-name" not in default  # the demo model
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--model-path", "/ckpt/qwen"])  # the old name is gone

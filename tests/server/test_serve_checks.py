"""What `conveyor serve` (and LLM) check before loading a model, and the names it serves under.

Every mistake is one line saying what to do, found before any weight is read: the folder and
its files before torch is imported, the port before the engine is built, the KV cache size
before the weights load.
"""

from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tests.serve_process import conveyor_command, free_port

from conveyor import LLM, AsyncLLM
from conveyor.cli import main
from conveyor.config import EngineConfig
from conveyor.entrypoints.model_names import served_model_names
from conveyor.server.config import build_serve_config

PREFIX = "conveyor serve: error: "


def _serve_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run `conveyor serve ARGS` in this process; it must exit 2 with one error line."""
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(PREFIX) and err.count("\n") == 1, err
    return err.removeprefix(PREFIX).rstrip("\n")


@pytest.fixture
def weights_only(demo_model_dir: Path, tmp_path: Path) -> Path:
    """A checkpoint folder with config.json and the weights but no tokenizer files."""
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(demo_model_dir / name, folder / name)
    return folder


def test_a_missing_model_folder_is_reported_without_importing_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from conveyor.cli import main; "
        "rc = main(['serve', '--model', 'no-such-folder']); print(rc, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert done.stderr.startswith(f"{PREFIX}model folder not found: 'no-such-folder' (looked in ")
    assert "; --model takes a local checkpoint folder with config.json" in done.stderr


def test_a_hub_id_as_model_says_how_to_download_it(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    err = _serve_error(capsys, "--model", "Qwen/Qwen2.5-0.5B-Instruct")
    assert "conveyor loads local folders only" in err
    assert (
        "`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir "
        "models/Qwen2.5-0.5B-Instruct`, then pass --model models/Qwen2.5-0.5B-Instruct." in err
    )


def test_malformed_config_json_names_the_file_line_and_column(capsys, tmp_path) -> None:
    (tmp_path / "config.json").write_text('{\n  "hidden_size": 256,,\n}\n')
    expected = (
        f"{tmp_path}/config.json is not valid JSON: Expecting property name enclosed in double "
        "quotes (line 2 column 22)."
    )
    assert _serve_error(capsys, "--model", str(tmp_path)) == expected
    with pytest.raises(ValueError) as info:
        LLM(str(tmp_path))
    assert str(info.value) == expected


def test_a_checkpoint_without_a_tokenizer_says_to_pass_one(
    capsys, weights_only, demo_model_dir
) -> None:
    expected = (
        f"no tokenizer in {weights_only} (none of tokenizer.json, tokenizer_config.json, "
        "tokenizer.model); pass --tokenizer DIR or copy the tokenizer files into it."
    )
    assert _serve_error(capsys, "--model", str(weights_only)) == expected
    with pytest.raises(ValueError) as info:
        LLM(str(weights_only))
    assert str(info.value) == expected
    # With --tokenizer the same folder passes the checks.
    engine, _ = build_serve_config(
        None, {"model": str(weights_only), "tokenizer": str(demo_model_dir)}
    )
    assert engine.tokenizer == str(demo_model_dir)


def test_an_unknown_scheduler_is_refused_by_the_config(capsys, demo_model_dir) -> None:
    expected = (
        "scheduler must be one of fifo, length-aware, preemptive-sjf, priority, sjf, static; "
        "got 'lifo'."
    )
    assert _serve_error(capsys, "--model", str(demo_model_dir), "--scheduler", "lifo") == expected
    with pytest.raises(ValueError) as info:  # no model, no KV cache: the config alone
        EngineConfig(scheduler="lifo")
    assert str(info.value) == expected


def test_a_busy_port_fails_before_the_model_loads(demo_model_dir, tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        command = [*conveyor_command(), "serve", "--model", str(demo_model_dir)]
        command += ["--host", "127.0.0.1", "--port", str(port)]
        # The timeout only guards against a hang; the output shows that nothing loaded.
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        f"{PREFIX}port {port} on 127.0.0.1 is already in use; choose another with --port.\n"
    )


def test_a_kv_cache_larger_than_free_memory_is_one_line_naming_the_flag(
    capsys, demo_model_dir
) -> None:
    port = free_port()
    args = ["--model", str(demo_model_dir), "--no-engine-process", "--port", str(port)]
    # Enough sequences that the cap (what max_num_seqs sequences can use) is not what binds.
    many = ("--max-num-seqs", str(10**8))
    err = _serve_error(capsys, *args, *many, "--kv-cache-space-gb", "100000")
    assert re.fullmatch(
        r"the KV cache needs 100000\.0 GiB \(\d+ blocks\) but only [\d.]+ GiB of (CPU|CUDA) "
        r"memory is available; lower --kv-cache-space-gb \(now 100000\) or set "
        r"--num-kv-blocks \(about \d+ fit\)\.",
        err,
    ), err
    err = _serve_error(capsys, *args, "--num-kv-blocks", str(10**10))
    assert re.search(r"; lower --num-kv-blocks \(now 10000000000; about \d+ fit\)\.$", err), err
    with socket.socket() as again:  # the failed server let go of its port
        again.bind(("127.0.0.1", port))


def test_max_model_len_above_the_context_is_capped_with_a_warning(demo_model_dir, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="conveyor"):
        llm = LLM(str(demo_model_dir), max_model_len=100_000, num_kv_blocks=128)
    assert llm.llm_engine.max_model_len == 2048
    assert (
        "max_model_len 100000 is more than the model's context (max_position_embeddings in "
        "config.json); capped to 2048." in caplog.messages
    )


def test_the_served_name_defaults_to_the_checkpoint_folders_name(
    demo_model_dir, tmp_path, monkeypatch
) -> None:
    shutil.copytree(demo_model_dir, tmp_path / "my-checkpoint" / "hf")
    monkeypatch.chdir(tmp_path / "my-checkpoint")
    engine = AsyncLLM("hf/", num_kv_blocks=16, log_stats_interval_s=0)
    assert (engine.model_name, engine.served_model_names) == ("hf", ["hf"])
    assert engine.metrics.render().count(b'model_name="hf"') > 0
    monkeypatch.chdir(tmp_path / "my-checkpoint" / "hf")
    assert served_model_names(None, ".") == ["hf"]
    assert served_model_names(None, None) == ["conveyor-demo"]
    assert served_model_names(["a", "b", "a"], "hf") == ["a", "b"]

"""`conveyor serve` settings (defaults < configs/*.yaml < flags), the shipped configs, and what
can be checked of the Dockerfile without a docker engine (its wheel build, its entrypoint)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from conveyor.cli import build_parser, main
from conveyor.config import EngineConfig
from conveyor.server.config import ServerConfig, build_serve_config, read_config_file

ROOT = Path(__file__).resolve().parents[2]


def test_flags_override_the_config_file(tmp_path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("port: 9001\nmax-num-seqs: 8\nscheduler: sjf\napi_key: from-file\n")
    engine, server = build_serve_config(config, {"port": 9002, "scheduler": None})
    assert (server.port, server.api_key, engine.max_num_seqs) == (9002, "from-file", 8)
    assert engine.scheduler == "sjf"  # a flag left unset (None) keeps the file's value


def test_unknown_key_is_an_error_naming_it(tmp_path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("max_num_seq: 8\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) in .*: max_num_seq\. Known keys"):
        read_config_file(config)


@pytest.mark.parametrize(
    ("text", "match"),
    [("- a\n- b\n", "mapping"), ("port: [\n", "not valid YAML"), ("port: 0\n", "port must")],
)
def test_bad_config_files_are_clear_errors(tmp_path, text, match) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=match):
        build_serve_config(config, {})


def test_missing_file_and_env_api_key(tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="cannot read config file"):
        build_serve_config(tmp_path / "nope.yaml", {})
    monkeypatch.setenv("CONVEYOR_API_KEY", "from-env")
    assert build_serve_config(None, {})[1].api_key == "from-env"
    assert build_serve_config(None, {"api_key": "flag"})[1].api_key == "flag"


def test_shipped_configs_load_and_default_yaml_states_the_defaults() -> None:
    for name in ("default.yaml", "demo.yaml"):
        build_serve_config(ROOT / "configs" / name, {})
    documented = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            if f.name in documented:
                assert documented[f.name] == f.default, f.name


def test_cli_serve_with_a_bad_config_exits_2_without_a_traceback(tmp_path, capsys) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("prot: 8000\n")
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conveyor serve: error: unknown key(s)") and "Traceback" not in err


def test_cli_serve_has_the_design_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--host", "h", "--port", "1", "--config", "c.yaml",
         "--scheduler", "fifo", "--max-num-seqs", "2", "--max-num-batched-tokens", "3",
         "--block-size", "16", "--num-kv-blocks", "4", "--api-key", "k",
         "--served-model-name", "n"]
    )  # fmt: skip
    assert (args.model, args.port, args.max_num_batched_tokens, args.served_model_name) == (
        "m",
        1,
        3,
        ["n"],
    )


def test_served_model_name_takes_aliases_from_the_flag_and_the_yaml_file(tmp_path) -> None:
    args = vars(build_parser().parse_args(["serve", "--served-model-name", "qwen", "q", "qwen"]))
    overrides = {k: v for k, v in args.items() if k not in ("command", "func", "config")}
    assert build_serve_config(None, overrides)[1].served_model_name == ["qwen", "q"]
    config = tmp_path / "c.yaml"
    config.write_text("served-model-name: [qwen, q]\n")
    assert build_serve_config(config, {})[1].served_model_name == ["qwen", "q"]
    config.write_text("served-model-name: qwen\n")  # one name may stay a plain string
    assert build_serve_config(config, {})[1].served_model_name == ["qwen"]
    for bad in ([], [""], ["ok", 3], 5):
        with pytest.raises(ValueError, match="served_model_name must be a non-empty name"):
            ServerConfig(served_model_name=bad)


def test_scheduling_and_admission_flags_reach_the_configs(tmp_path) -> None:
    flags = ["--scheduler", "preemptive-sjf", "--aging-bound-s", "inf", "--preemption-threshold",
             "0.25", "--preemption-cooldown-s", "0", "--max-waiting-requests", "7", "--max-n", "3",
             "--max-request-body-bytes", "2048", "--request-timeout", "1.5"]  # fmt: skip
    args = vars(build_parser().parse_args(["serve", *flags]))
    overrides = {k: v for k, v in args.items() if k not in ("command", "func", "config")}
    engine, server = build_serve_config(None, overrides)
    knobs = (engine.aging_bound_s, engine.preemption_threshold, engine.preemption_cooldown_s)
    assert knobs == (float("inf"), 0.25, 0.0)
    limits = (server.max_waiting_requests, server.max_n, server.max_request_body_bytes)
    assert limits == (7, 3, 2048)
    assert server.request_timeout == 1.5
    config = tmp_path / "c.yaml"
    config.write_text("aging-bound-s: .inf\nrequest_timeout: 30\nmax_n: 4\n")
    engine, server = build_serve_config(config, {})
    assert (engine.aging_bound_s, server.request_timeout, server.max_n) == (float("inf"), 30, 4)


@pytest.mark.parametrize(
    ("key", "value"),
    [("max_waiting_requests", 0), ("max_n", -1), ("max_request_body_bytes", 1.5),
     ("request_timeout", 0), ("request_timeout", float("inf")), ("preemption_threshold", 2)],
)  # fmt: skip
def test_bad_limits_are_clear_errors(key, value) -> None:
    with pytest.raises(ValueError, match=key):
        build_serve_config(None, {key: value})


def _dockerfile_json(instruction: str) -> list[list[str]]:
    """The exec-form arguments of every `instruction` line of the Dockerfile."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [json.loads(m) for m in re.findall(rf"^{instruction} (?:.*?CMD )?(\[.*\])$", text, re.M)]


def test_dockerfile_targets_user_volume_and_entrypoint() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM .* AS cpu$", text, re.M) and re.search(
        r"^FROM .* AS cuda$", text, re.M
    )
    assert text.rstrip().splitlines()[-1] == "CMD []"  # the last stage (the default) is cuda
    assert text.count("USER conveyor") == 2 and 'VOLUME ["/models"]' in text
    for entrypoint in _dockerfile_json("ENTRYPOINT"):
        assert entrypoint[:2] == ["conveyor", "serve"]
        args = build_parser().parse_args([*entrypoint[1:], "--model", "/models/m"])
        assert (args.host, args.port, args.model) == ("0.0.0.0", 8000, "/models/m")
    checks = _dockerfile_json("HEALTHCHECK")
    assert len(checks) == 2 and all("http://127.0.0.1:8000/health" in c[-1] for c in checks)


def test_dockerfile_wheel_stage_builds_a_wheel_with_the_server(tmp_path) -> None:
    # The wheel stage is `COPY . .` (minus .dockerignore) then `pip wheel --no-deps .`.
    ignored = [
        line.strip().removeprefix("**/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    src = tmp_path / "context"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*ignored, "*.egg-info", "build"))
    assert not (src / "tests").exists() and (src / "src" / "conveyor" / "server").is_dir()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "--wheel-dir", str(tmp_path / "wheels"), str(src)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "wheels").glob("conveyor-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in (
        "server/app.py", "server/launch.py", "entrypoints/async_llm.py", "entrypoints/metrics.py",
        "kernels/attention.py",
    ):  # fmt: skip
        assert f"conveyor/{module}" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "conveyor = conveyor.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_engine_process_is_the_default_and_can_be_turned_off() -> None:
    assert build_serve_config(None, {})[1].engine_process is True
    assert build_serve_config(None, {"engine_process": False})[1].engine_process is False
    with pytest.raises(ValueError, match="engine_process must be true or false"):
        build_serve_config(None, {"engine_process": "no"})


def test_several_api_keys_and_the_tenant_source_come_from_flags_env_and_yaml(
    tmp_path, monkeypatch
) -> None:
    args = vars(build_parser().parse_args(
        ["serve", "--api-key", "a", "b", "--api-key", "c", "--cache-salt-from", "api-key"]
    ))  # fmt: skip
    overrides = {k: v for k, v in args.items() if k not in ("command", "func", "config")}
    server = build_serve_config(None, overrides)[1]
    assert (server.api_keys, server.cache_salt_from) == (["a", "b", "c"], "api-key")
    monkeypatch.setenv("CONVEYOR_API_KEY", "k1, k2,k1")
    assert build_serve_config(None, {})[1].api_keys == ["k1", "k2"]
    config = tmp_path / "c.yaml"
    config.write_text("api_key: [x, y]\ncache-salt-from: 'header:X-Tenant'\n")
    assert build_serve_config(config, {})[1].api_keys == ["x", "y"]
    assert ServerConfig(api_key="one").api_keys == ["one"] and ServerConfig().api_keys == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cache_salt_from": "api-key"}, "cache_salt_from api-key needs api_key"),
        ({"cache_salt_from": "header:"}, "cache_salt_from must be api-key or header:NAME"),
        ({"cache_salt_from": "header:X Tenant"}, "cache_salt_from must be"),
        ({"cache_salt_from": "tenant"}, "cache_salt_from must be"),
        ({"api_key": []}, "api_key must be a non-empty string or a list of them"),
        ({"api_key": ["ok", ""]}, "api_key must be a non-empty string or a list of them"),
    ],
)
def test_bad_tenancy_settings_are_clear_errors(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kwargs)

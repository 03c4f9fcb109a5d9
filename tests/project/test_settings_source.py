"""Each setting is written once, as a field of EngineConfig or ServerConfig
(conveyor/config/settings.py): the `conveyor serve` flags, configs/default.yaml and
docs/configuration.md's table follow it.

When one of these fails after a setting changed: `python -m conveyor.config_docs --write`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conveyor import config_docs
from conveyor.cli import build_parser
from conveyor.config import EngineConfig
from conveyor.config.settings import SECTIONS, default_text, value_type
from conveyor.core.policies import BUILTIN_POLICIES, available_policies
from conveyor.server.config import ServerConfig, build_serve_config

ROOT = Path(__file__).resolve().parents[2]
FIELDS = [f for cls in (EngineConfig, ServerConfig) for f in dataclasses.fields(cls)]
REGENERATE = "stale: run `python -m conveyor.config_docs --write`"


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def _flags(name: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in _subparser(name)._actions if a.option_strings and a.dest != "help"}


def test_every_field_documents_itself() -> None:
    for f in FIELDS:
        assert f.metadata.get("help"), f"{f.name}: made without conveyor.config.settings.setting"
        assert f.metadata["section"] in SECTIONS, f.name
        assert (f.default is None) == (f.metadata["unset"] is not None), f.name


def test_default_yaml_is_generated_from_the_fields() -> None:
    text = (ROOT / "configs" / "default.yaml").read_text(encoding="utf-8")
    assert text == config_docs.default_yaml(), REGENERATE
    documented = yaml.safe_load(text)
    assert documented == {f.name: f.default for f in FIELDS}  # every key, each its default


def test_configuration_table_is_generated_from_the_fields() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == config_docs.with_table(page), REGENERATE
    table = page[page.index(config_docs.TABLE_BEGIN) : page.index(config_docs.TABLE_END)]
    for f in FIELDS:
        assert f"| `{f.name}` | `--{f.name.replace('_', '-')}`" in table, f.name


def test_config_docs_check_passes_and_yaml_prints(capsys) -> None:
    assert config_docs.main(["--check"]) == 0
    assert config_docs.main(["--yaml"]) == 0
    assert capsys.readouterr().out == config_docs.default_yaml()


def test_serve_has_one_flag_per_field_showing_the_fields_default() -> None:
    flags = _flags("serve")
    assert set(flags) == {f.name for f in FIELDS} | {"config"}
    for f in FIELDS:
        action = flags[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert action.default is None, f"{f.name}: an unset flag must not hide the YAML value"
        if value_type(f) is bool:
            assert isinstance(action, argparse.BooleanOptionalAction), f.name
        else:
            assert action.type is value_type(f), f.name
        shown = f"(default: {default_text(f)})".replace("%", "%%")
        assert action.help.endswith(shown), f"{f.name}: {action.help!r}"


def test_serve_without_flags_runs_on_the_field_defaults(monkeypatch) -> None:
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    args = vars(build_parser().parse_args(["serve"]))
    flags = {k: v for k, v in args.items() if k not in ("command", "func", "config")}
    assert build_serve_config(None, flags) == (EngineConfig(), ServerConfig())


def test_simulate_engine_flags_default_to_their_fields() -> None:
    flags = _flags("simulate")
    own = {"scheduler": "all", "max_num_seqs": None}  # the simulator's own defaults
    for f in dataclasses.fields(EngineConfig):
        if f.name in flags and f.name not in ("seed",):  # --seed: the workload's seed
            assert flags[f.name].default == own.get(f.name, f.default), f.name


def test_the_api_key_variable_is_named_and_read_in_one_place() -> None:
    found = []
    for path in (ROOT / "src" / "conveyor").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value == "CONVEYOR_API_KEY":
                found.append(path.relative_to(ROOT).as_posix())
    assert found == ["src/conveyor/server/config.py"]
    source = (ROOT / "src" / "conveyor" / "server" / "config.py").read_text(encoding="utf-8")
    assert source.count("os.environ") == 1


def test_policies_are_an_explicit_list_and_core_does_not_import_engine() -> None:
    assert available_policies() == sorted(cls.name for cls in BUILTIN_POLICIES)
    code = (
        "import sys, conveyor.core.scheduler, conveyor.core.policies\n"
        "print(sorted(m for m in sys.modules if m.startswith('conveyor.engine')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    # No module of core/ imports engine/ but for type annotations (under TYPE_CHECKING).
    for path in (ROOT / "src" / "conveyor" / "core").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("conveyor.engine"), path.name


@pytest.mark.parametrize("name", ["default.yaml", "demo.yaml"])
def test_cli_serve_reads_the_shipped_yaml_files(name) -> None:
    args = build_parser().parse_args(["serve", "--config", str(ROOT / "configs" / name)])
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func", "config")}
    engine, server = build_serve_config(args.config, {**flags, "port": 9100})
    assert server.port == 9100  # the flag wins over the file
    if name == "demo.yaml":
        assert (engine.num_kv_blocks, server.shutdown_timeout) == (1024, 5.0)

"""configs/default.yaml and docs/configuration.md's settings table, generated from the fields.

    python -m conveyor.config_docs --write   # rewrite both after changing a setting
    python -m conveyor.config_docs --check   # exit 1 if either disagrees with the fields
    python -m conveyor.config_docs --yaml    # print the YAML file (--table: the table)

The fields of EngineConfig and ServerConfig (conveyor/config/settings.py) are the one source; these
two files are their rendering, and tests/project/test_settings_source.py fails when they drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from pathlib import Path

from conveyor.config.settings import SECTIONS, choices_text, flag_name, shown, value_type

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_YAML = Path("configs") / "default.yaml"
CONFIGURATION_MD = Path("docs") / "configuration.md"
TABLE_BEGIN = (
    "<!-- settings table: generated from EngineConfig and ServerConfig by "
    "`python -m conveyor.config_docs --write`; edit the fields, not this table -->"
)
TABLE_END = "<!-- end of the settings table -->"

_YAML_HEADER = """\
# conveyor serve --config configs/default.yaml
#
# Every setting with its built-in default. Flags given on the command line override this
# file (e.g. `--port 9000`); keys may be written with `_` or `-`; an unknown key is an error.
# Engine keys are the fields of conveyor.config.EngineConfig, server keys those of
# conveyor.server.config.ServerConfig; this file is generated from them
# (`python -m conveyor.config_docs --write`): change a setting there, not here.
"""
_COMMENT_COLUMN = 28
_WIDTH = 99


def _classes() -> tuple[type, ...]:
    from conveyor.config import EngineConfig
    from conveyor.server.config import ServerConfig

    return (EngineConfig, ServerConfig)


def _by_section() -> list[tuple[str, list[dataclasses.Field]]]:
    fields = [f for cls in _classes() for f in dataclasses.fields(cls)]
    return [(s, [f for f in fields if f.metadata["section"] == s]) for s in SECTIONS]


def _yaml_value(value: object) -> str:
    if isinstance(value, str):
        import yaml

        return value if yaml.safe_load(value) == value else json.dumps(value)
    return shown(value)


def _comment(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    if choices_text(f):
        text += f"; one of {choices_text(f)}"
    if f.default is None:
        text += f"; null: {f.metadata['unset']}"
    return text


def default_yaml() -> str:
    """configs/default.yaml: every key with its default and a comment from its help."""
    out = [_YAML_HEADER]
    for section, fields in _by_section():
        out.append(f"\n# {'-' * 64} {section}\n")
        for f in fields:
            line = f"{f.name}: {_yaml_value(f.default)}"
            start = max(_COMMENT_COLUMN, len(line) + 1)
            # The first line starts after the value, the others at the comment column.
            pad = " " * (start - _COMMENT_COLUMN)
            first, *rest = textwrap.wrap(
                _comment(f), _WIDTH - _COMMENT_COLUMN - 2, initial_indent=pad
            )
            out.append(f"{line.ljust(start)}# {first.strip()}\n")
            out.extend(f"{' ' * _COMMENT_COLUMN}# {more}\n" for more in rest)
    return "".join(out)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def _flag(f: dataclasses.Field) -> str:
    if value_type(f) is bool:
        return f"`{flag_name(f)}`, `--no-{flag_name(f)[2:]}`"
    return f"`{flag_name(f)}`"


def settings_table() -> str:
    """docs/configuration.md's table of every setting (between its markers)."""
    out = []
    for section, fields in _by_section():
        out.append(f"\n**{section}**\n\n")
        out.append("| key | flag | default | what it sets |\n|---|---|---|---|\n")
        for f in fields:
            default = f"`{_yaml_value(f.default)}`" if f.default is not None else "null: "
            if f.default is None:
                default += _cell(f.metadata["unset"])
            what = f.metadata["help"]
            if choices_text(f):
                what += f"; one of {choices_text(f)}"
            out.append(f"| `{f.name}` | {_flag(f)} | {default} | {_cell(what)} |\n")
    return "".join(out)


def with_table(page: str) -> str:
    """The page with the text between its table markers replaced by `settings_table()`."""
    begin, end = page.index(TABLE_BEGIN) + len(TABLE_BEGIN), page.index(TABLE_END)
    return page[:begin] + "\n" + settings_table() + "\n" + page[end:]


def _targets(root: Path) -> dict[Path, str]:
    page = (root / CONFIGURATION_MD).read_text(encoding="utf-8")
    return {root / DEFAULT_YAML: default_yaml(), root / CONFIGURATION_MD: with_table(page)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.config_docs", description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--yaml", action="store_true", help="print configs/default.yaml")
    mode.add_argument("--table", action="store_true", help="print the settings table")
    mode.add_argument("--write", action="store_true", help="rewrite both files")
    mode.add_argument("--check", action="store_true", help="exit 1 if either file is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this)")
    args = parser.parse_args(argv)
    if args.yaml or args.table:
        sys.stdout.write(default_yaml() if args.yaml else settings_table())
        return 0
    stale = []
    for path, text in _targets(args.root).items():
        if path.read_text(encoding="utf-8") != text:
            stale.append(str(path.relative_to(args.root)))
            if args.write:
                path.write_text(text, encoding="utf-8")
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run python -m conveyor.config_docs --write")
        return 1
    if args.write:
        print(f"rewrote {', '.join(stale)}" if stale else "up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

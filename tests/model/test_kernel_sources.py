"""The C kernels' sources keep their shape (docs/kernels.md#the-c-sources-one-grammar): the
include graph has no cycle, counting as an edge a header whose code calls a function whose
definition is in another file, and no .c file declares another file's functions (kernels.h
alone does). Read from the preprocessor's output at each instruction-set level, so the code
under every #if and the names the templates paste together are seen."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from conveyor.model.cpu import cpu_build

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here"
)

_LEVELS = (["-march=x86-64-v4", "-mavx512bf16"], ["-march=x86-64-v3"], ["-march=x86-64"])
_TOKEN = re.compile(r"[A-Za-z_]\w*|[{}();]")


def _code(line: str) -> str:
    """line without string literals and __attribute__((...))s (names in them are not code)."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    while (at := line.find("__attribute__")) >= 0:
        depth, end = 0, at + len("__attribute__")
        while end < len(line):
            depth += {"(": 1, ")": -1}.get(line[end], 0)
            end += 1
            if depth == 0 and line[end - 1] == ")":
                break
        line = line[:at] + line[end:]
    return line


def _tokens(src) -> list[tuple[str | None, str, int]]:
    """(the csrc file it comes from or None, token, brace depth) of src preprocessed."""
    out, origin, depth = [], None, 0
    for march in _LEVELS:
        pp = subprocess.run(
            [*cpu_build.compiler(), "-E", "-fopenmp", "-std=c11", *march, str(src)],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        for line in pp.splitlines():
            if marker := re.match(r'# \d+ "([^"]+)"', line):
                path = marker.group(1)
                here = os.path.dirname(os.path.abspath(path)) == str(cpu_build.CSRC)
                origin = os.path.basename(path) if here else None
                continue
            for tok in _TOKEN.findall(_code(line)):
                depth -= tok == "}"
                out.append((origin, tok, depth))
                depth += tok == "{"
    return out


def _statements(tokens):
    """Top-level statements: (their tokens, whether they open a body)."""
    stmt = []
    for origin, tok, depth in tokens:
        if depth:
            continue
        if tok in (";", "{"):
            yield stmt, tok == "{"
            stmt = []
        elif tok != "}":
            stmt.append((origin, tok))


def _named(stmt) -> tuple[str | None, str] | None:
    """A function statement's name and where it is written: the first identifier before `(`;
    None for a static function (or no function)."""
    names = [t for _, t in stmt]
    if "static" in names or "typedef" in names:
        return None
    for i, (origin, tok) in enumerate(stmt[:-1]):
        if stmt[i + 1][1] == "(" and not tok.startswith("_"):
            return origin, tok
    return None


def test_no_include_cycle_and_no_c_file_declares_another_files_functions():
    files = sorted(p.name for p in cpu_build.CSRC.iterdir() if p.suffix in (".c", ".h"))
    text = {f: (cpu_build.CSRC / f).read_text() for f in files}
    graph = {f: set(re.findall(r'#include "([^"]+)"', text[f])) for f in files}
    streams = {src.name: _tokens(src) for src in cpu_build.sources()}
    defined, declared = {}, []  # a function -> the file its definition is written in
    for tokens in streams.values():
        for stmt, body in _statements(tokens):
            if named := _named(stmt):
                if body:
                    defined[named[1]] = named[0]
                else:
                    declared.append(named)
    for origin, name in declared:
        if name in defined and origin != "kernels.h" and defined[name] != origin:
            pytest.fail(f"{origin} declares {name}, which {defined[name]} defines")
    for tokens in streams.values():  # a header's code calling another file's function
        for origin, tok, depth in tokens:
            if origin and origin.endswith(".h") and depth and defined.get(tok, origin) != origin:
                graph[origin].add(defined[tok])
    state: dict[str, int] = {}

    def visit(f: str, path: list[str]) -> None:
        state[f] = 1
        for g in sorted(graph.get(f, ())):
            assert state.get(g) != 1, f"include cycle: {' -> '.join([*path, f, g])}"
            if not state.get(g):
                visit(g, [*path, f])
        state[f] = 2

    for f in files:
        if not state.get(f):
            visit(f, [])

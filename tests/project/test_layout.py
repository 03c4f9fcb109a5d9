"""The package boundaries docs/architecture.md draws hold in the imports themselves."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "transformers", "fastapi", "uvicorn")


@pytest.mark.parametrize(
    "module",
    [
        "conveyor.core",
        "conveyor.core.scheduler",
        "conveyor.core.policies",
        "conveyor.config",
        "conveyor.engine.outputs",
        "conveyor.model.attention.registry",
        "conveyor.simulator",
        "conveyor.model.loading.checkpoint",
        "conveyor.model.loading.pooling_config",
        "conveyor.pooling_params",
    ],
)
def test_plain_python_modules_import_no_torch(module):
    code = f"import sys, {module}\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"{module} pulled in {result.stdout.strip()}"


def _imports(package: str) -> dict[str, set[str]]:
    """Module names each file of src/conveyor/<package> imports (top level and in functions)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "src" / "conveyor" / package
    found = {}
    for path in root.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        found[str(path.relative_to(root))] = names
    return found


def _offending(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    return {
        file: sorted(n for n in names if n.startswith(forbidden))
        for file, names in _imports(package).items()
        if any(n.startswith(forbidden) for n in names)
    }


def test_model_knows_nothing_of_http():
    assert _offending("model", ("fastapi", "starlette", "uvicorn", "conveyor.server")) == {}


def test_server_knows_nothing_of_blocks_or_tensors():
    forbidden = ("torch", "conveyor.core", "conveyor.model", "conveyor.kernels")
    offending = _offending("server", forbidden)
    # The one exception: the plain-Python checks of a checkpoint folder, which `conveyor
    # serve` runs before it loads anything (model/loading/checkpoint.py imports no torch).
    assert offending.pop("config.py", None) in (None, ["conveyor.model.loading.checkpoint"])
    assert offending == {}


def test_core_imports_only_core_and_the_plain_shared_modules():
    allowed = ("conveyor.core", "conveyor.config", "conveyor.sampling_params",
               "conveyor.validation")  # fmt: skip
    imported = {n for names in _imports("core").values() for n in names}
    assert sorted(n for n in imported if n.startswith("conveyor") and
                  not n.startswith(allowed)) == []  # fmt: skip


def test_settings_import_nothing_above_them():
    # Registries of higher layers (policies, attention backends) are named, not imported:
    # conveyor.config.settings.lazy_choices.
    allowed = ("conveyor.config", "conveyor.pooling_params", "conveyor.validation")
    imported = {n for names in _imports("config").values() for n in names}
    assert sorted(n for n in imported if n.startswith("conveyor") and
                  not n.startswith(allowed)) == []  # fmt: skip


def test_structured_imports_only_the_layers_below_it():
    allowed = ("conveyor.structured", "conveyor.core.sequence", "conveyor.json_depth",
               "conveyor.structured_params")  # fmt: skip
    imported = {n for names in _imports("structured").values() for n in names}
    assert sorted(n for n in imported if n.startswith("conveyor") and
                  not n.startswith(allowed)) == []  # fmt: skip

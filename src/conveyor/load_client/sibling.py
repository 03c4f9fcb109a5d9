"""Benchmark scripts (benchmarks/*.py) share code by loading each other from their folder:
they are scripts, not a package, and tests load them by path too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_sibling(script: str, name: str) -> ModuleType:
    """The module `name`.py next to the file `script` (pass __file__), loaded once per
    process (kept in sys.modules as bench_<name>)."""
    key = f"bench_{name}"
    module = sys.modules.get(key)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(key, Path(script).resolve().parent / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no benchmark script {name}.py next to {script}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module

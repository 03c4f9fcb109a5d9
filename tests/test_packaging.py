"""Every package ships: the hand-written package list in pyproject.toml covers src/ and kernels/."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package_folder():
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join(init.parent.relative_to(ROOT / "src").parts)
        for init in (ROOT / "src").rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == found | {"conveyor.kernels"}
    assert setuptools["package-dir"]["conveyor.kernels"] == "kernels"


def test_wheel_installs_the_kernels_as_conveyor_kernels(tmp_path):
    # Built from a clean copy: an in-tree build/ could carry stale modules into the wheel.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "tests", "docs")
    shutil.copytree(ROOT, src, ignore=skip)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "--wheel-dir", str(tmp_path / "wheels"), str(src)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "wheels").glob("conveyor-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("__init__.py", "attention.py", "kv_write.py"):
        assert f"conveyor/kernels/{module}" in names
    assert not any(n.startswith("kernels/") for n in names)  # not a top-level package

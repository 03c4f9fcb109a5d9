"""Every package ships: the hand-written package list in pyproject.toml covers src/ and kernels/."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_folder_is_the_conveyor_kernels_package():
    # kernels/ stays at the top level; src/conveyor/kernels links to it, so every package is
    # under src/ and setuptools' package discovery (and a plain editable path entry) finds it.
    link = ROOT / "src" / "conveyor" / "kernels"
    assert link.is_symlink()
    assert link.resolve() == (ROOT / "kernels").resolve()
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["where"] == ["src"]
    assert "package-dir" not in setuptools  # a mapped package forces a finder-based install


def test_import_works_beside_a_folder_named_conveyor(tmp_path):
    # A clone named conveyor/ in the working directory must not shadow the installed package
    # as a namespace package (it did while the editable install used an import finder).
    (tmp_path / "conveyor").mkdir()
    code = "import conveyor.kernels; from conveyor import LLM; print(conveyor.__file__)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).parent.name == "conveyor"


def test_wheel_installs_the_kernels_as_conveyor_kernels_and_the_c_source(tmp_path):
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
    assert "conveyor/model/csrc/paged_attention.c" in names  # built at run time

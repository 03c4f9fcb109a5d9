"""Every package ships (src/ and kernels/), with every C source and header of the CPU kernels;
an installed wheel or sdist, outside the checkout, builds and runs those kernels."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds and installs a wheel and an sdist

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_checkout_root_does_not_shadow_a_package_named_kernels(tmp_path):
    # transformers >= 5.25 imports Hugging Face's `kernels`. With the checkout's root first on
    # sys.path (python -m pytest, an engine process's python -c, both run there) our kernels/
    # folder must lose to any installed package of that name: it is a namespace portion.
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'the installed one'\n")
    code = "import kernels, conveyor.kernels.launchers; print(kernels.WHO)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "the installed one"


def test_import_works_beside_a_folder_named_conveyor(tmp_path):
    # A clone named conveyor/ in the working directory must not shadow the installed package
    # as a namespace package (it did while the editable install used an import finder).
    (tmp_path / "conveyor").mkdir()
    code = "import conveyor.kernels.launchers; from conveyor import LLM; print(conveyor.__file__)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).parent.name == "conveyor"


def _clean_copy(tmp_path: Path) -> Path:
    # Built from a clean copy: an in-tree build/ could carry stale modules into the wheel.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "tests", "docs")
    shutil.copytree(ROOT, src, ignore=skip, symlinks=True)
    return src


def _pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "-q"],
        check=True, capture_output=True,
    )  # fmt: skip


# What a user meets: the installed package (first on the path), started from a folder with no
# checkout in it, builds its C kernels into an empty cache and takes the C GEMM where the CPU
# has AVX2 + FMA.
_USER_CHECK = """
import importlib.util, json, torch
import conveyor
from conveyor.model.cpu import cpu_build, cpu_kernels
from conveyor.model.cpu.linear import resolve_linear_backend
kernels = cpu_kernels.load()
print(json.dumps({
    "file": conveyor.__file__,
    "kernels": importlib.util.find_spec("conveyor.kernels.attention").origin,
    "loaded": kernels is not None,
    "library": kernels and kernels.path,
    "avx2": cpu_build._X86_V3 <= cpu_build.cpu_flags(),
    "auto": resolve_linear_backend("auto", torch.device("cpu"), torch.float32),
}))
"""


def _check_installed(target: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("CONVEYOR_CPU_ISA", "PYTHONPATH")}
    env.update(PYTHONPATH=str(target), CONVEYOR_CACHE_DIR=str(cache))
    neutral = tmp_path / "elsewhere"
    neutral.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", _USER_CHECK], cwd=neutral, env=env, capture_output=True,
        text=True, check=False, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "unavailable" not in result.stderr, result.stderr  # load() logs why it fell back
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(target), got["file"]
    assert Path(got["kernels"]).is_relative_to(target), got["kernels"]  # the Triton package
    assert got["loaded"], result.stderr
    assert Path(got["library"]).is_relative_to(cache)  # built there, from the installed source
    assert got["auto"] == ("cpu" if got["avx2"] else "onednn")


needs_cc = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here"
)


def _csrc_files() -> set[str]:
    return {
        f"conveyor/model/cpu/csrc/{p.name}"
        for p in (ROOT / "src/conveyor/model/cpu/csrc").iterdir()
    }


@needs_cc
def test_the_wheel_carries_every_kernel_source_and_its_install_runs_the_c_kernels(tmp_path):
    src = _clean_copy(tmp_path)
    _pip("wheel", "--wheel-dir", str(tmp_path / "wheels"), str(src))
    (wheel,) = (tmp_path / "wheels").glob("conveyor-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("launchers.py", "attention.py", "kv_write.py", "_checks.py"):
        assert f"conveyor/kernels/{module}" in names
    assert not any(n.startswith("kernels/") for n in names)  # not a top-level package
    assert _csrc_files() <= names  # every .c and every header they include
    target = tmp_path / "site"
    _pip("install", "--target", str(target), str(wheel))
    _check_installed(target, tmp_path)


@needs_cc
def test_the_sdist_carries_every_kernel_source_and_its_install_runs_the_c_kernels(tmp_path):
    src = _clean_copy(tmp_path)
    code = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-c", code, str(dist)], cwd=src, check=True, capture_output=True
    )
    (sdist,) = dist.glob("conveyor-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {f"src/{n}" for n in _csrc_files()} <= names
    target = tmp_path / "site"
    _pip("install", "--target", str(target), str(sdist))
    _check_installed(target, tmp_path)


def test_the_cpu_path_runs_without_triton(demo_model_dir, tmp_path):
    # The CPU Docker image uninstalls triton (only CUDA needs it): nothing on the CPU path may
    # import it. `sys.modules["triton"] = None` makes every `import triton` fail as if absent.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from conveyor import LLM, SamplingParams\n"
        f"llm = LLM({str(demo_model_dir)!r}, num_kv_blocks=32)\n"
        "out = llm.generate(['def f(x):'], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "print(len(out[0].outputs[0].token_ids), llm.llm_engine.runner.linear_backend)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[0] == "4"

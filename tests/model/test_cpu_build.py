"""Building the CPU C kernels: the cache and its key, a compiler command with arguments, a
cached file that is not ours, the instruction-set setting, and the ctypes signatures against
the C prototypes."""

from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

from conveyor.model.cpu import cpu_build, cpu_kernels, kernel_structs

pytestmark = pytest.mark.slow  # compiles the C kernels, at every level

needs_cc = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here"
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CONVEYOR_CPU_ISA", raising=False)  # tests/model/test_cpu_isa.py sets it
    return tmp_path / "cpu_kernels"


@pytest.fixture(scope="module")
def native_build():
    """The native library as this machine builds it, from the suite's own cache (built once):
    tests that start from a cache holding it copy it there rather than compile it again."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CC", raising=False)
        mp.delenv("CONVEYOR_CPU_ISA", raising=False)
        return cpu_build.build()


@pytest.fixture
def warm_cache(cache, native_build):
    """`cache` holding the native library and its digest, as a first build leaves them."""
    cache.mkdir(parents=True)
    for path in (native_build, native_build.with_name(native_build.name + ".sha256")):
        shutil.copy2(path, cache / path.name)
    return cache


def _built(cache):
    return sorted(p.name for p in cache.iterdir())


@needs_cc
def test_the_build_is_cached_with_its_digest_and_no_temporary_left(cache):
    first = cpu_build.build()
    assert first.parent == cache and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_build.build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert _built(cache) == [first.name, first.name + ".sha256"]


@needs_cc
def test_a_failed_compile_says_the_compilers_words_and_leaves_nothing_behind(cache, monkeypatch):
    cc = shutil.which("cc") or shutil.which("gcc")
    monkeypatch.setenv("CC", f"{cc} -include /nonexistent/conveyor_missing.h")
    with pytest.raises(RuntimeError, match=r"conveyor_missing\.h") as info:
        cpu_build.build()
    assert "failed" in str(info.value)
    assert _built(cache) == []  # no object folder, no half library, no digest


@needs_cc
@pytest.mark.parametrize("damage", ["truncated", "foreign", "no digest"])
def test_a_cached_library_that_is_not_the_one_built_is_rebuilt_not_loaded(
    warm_cache, damage, monkeypatch
):
    lib = cpu_build.build()
    assert lib.parent == warm_cache
    good = lib.read_bytes()
    if damage == "truncated":
        lib.write_bytes(good[: len(good) // 3])
    elif damage == "foreign":  # a valid shared object, but another build's, under this name
        monkeypatch.setenv("CONVEYOR_CPU_ISA", "portable")
        lib.write_bytes(cpu_build.build().read_bytes())
        monkeypatch.delenv("CONVEYOR_CPU_ISA")
    else:
        lib.with_name(lib.name + ".sha256").unlink()
    assert cpu_build.build() == lib
    assert lib.read_bytes() == good  # the compiler's output again (gcc is deterministic)
    kernels = cpu_kernels.CpuKernels(ctypes.CDLL(str(lib)))
    assert kernels.linear_vectorized in (True, False)


@needs_cc
def test_a_compiler_command_with_arguments_works_and_is_part_of_the_key(warm_cache, monkeypatch):
    plain = cpu_build.build()
    cc = shutil.which("cc") or shutil.which("gcc")
    # `ccache gcc` is the common case; `env gcc` is the same shape and always installed.
    monkeypatch.setenv("CC", f"env {cc}")
    wrapped = cpu_build.build()
    assert wrapped != plain and wrapped.exists()
    if shutil.which("ccache"):
        monkeypatch.setenv("CC", f"ccache {cc}")
        assert cpu_build.build().exists()


@needs_cc
def test_the_instruction_set_is_part_of_the_key(warm_cache, monkeypatch):
    native = cpu_build.build()
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "portable")
    portable = cpu_build.build()
    assert portable != native
    assert "-march=native" not in cpu_build.build_flags()
    kernels = cpu_kernels.CpuKernels(ctypes.CDLL(str(portable)))
    assert kernels.linear_vectorized is False  # the plain C GEMM, whatever this CPU has


def test_the_instruction_set_setting_is_checked(monkeypatch):
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="CONVEYOR_CPU_ISA must be one of portable, avx2"):
        cpu_build.requested_isa()
    monkeypatch.setenv("CONVEYOR_CPU_ISA", " AVX2 ")
    assert cpu_build.requested_isa() == "avx2"
    monkeypatch.delenv("CONVEYOR_CPU_ISA")
    assert cpu_build.requested_isa() == "native"


def test_each_instruction_set_maps_to_its_march_and_refuses_what_the_cpu_lacks():
    v4 = cpu_build._X86_V4
    assert cpu_build.isa_flags("native", "x86_64", set()) == ["-march=native"]
    assert cpu_build.isa_flags("portable", "x86_64", set()) == ["-march=x86-64"]
    assert cpu_build.isa_flags("avx2", "x86_64", v4) == ["-march=x86-64-v3"]
    assert cpu_build.isa_flags("avx512", "x86_64", v4) == ["-march=x86-64-v4"]
    bf16 = ["-march=x86-64-v4", "-mavx512bf16"]
    assert cpu_build.isa_flags("avx512bf16", "x86_64", v4 | {"avx512_bf16"}) == bf16
    with pytest.raises(ValueError, match=r"avx512bf16 needs CPU features this CPU lacks \(avx512_"):
        cpu_build.isa_flags("avx512bf16", "x86_64", v4)  # a Skylake-X: AVX-512, no BF16
    zen3 = cpu_build._X86_V3  # AVX2 only
    with pytest.raises(ValueError, match=r"avx512 needs CPU features this CPU lacks \(avx512bw"):
        cpu_build.isa_flags("avx512", "x86_64", zen3)
    with pytest.raises(ValueError, match="lacks"):
        cpu_build.isa_flags("avx2", "x86_64", {"sse2"})
    assert cpu_build.isa_flags("portable", "aarch64", set()) == ["-march=armv8-a"]
    with pytest.raises(ValueError, match="x86-64 instruction set; this machine is aarch64"):
        cpu_build.isa_flags("avx2", "aarch64", set())


@needs_cc
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 levels")
def test_each_level_reports_its_gemm_and_float32_results_do_not_depend_on_it(cache, monkeypatch):
    import torch

    from conveyor.model.cpu.linear import CpuLinear

    # Every level this CPU has, built side by side (one library each).
    names = {"avx2": "avx2", "avx512": "avx512", "avx512bf16": "avx512-bf16"}
    built = {}
    for isa, gemm in names.items():
        try:
            cpu_build.isa_flags(isa)
        except ValueError:
            continue  # a level this CPU lacks
        monkeypatch.setenv("CONVEYOR_CPU_ISA", isa)
        built[isa] = kernels = cpu_kernels.CpuKernels(ctypes.CDLL(str(cpu_build.build())))
        assert kernels.linear_isa == gemm
    if len(built) < 2:
        pytest.skip(f"this CPU has fewer than two vector levels ({', '.join(built)})")
    # The same sum per output in the same order (bias, then k), whatever the registers: float32
    # weights give bit for bit the same outputs on each, as do bf16 weights widened.
    torch.manual_seed(0)
    weight, bias = torch.randn(53, 301) / 17, torch.randn(53)
    for rows in (1, 7, 13, 300):
        x = torch.randn(rows, 301)
        outs = []
        for kernels in built.values():
            bf16 = CpuLinear(weight, bias, kernels, torch.bfloat16)
            widened = kernels.linear(x, bf16.packed_weight, 53, bf16.bias, widened=True)
            outs.append((CpuLinear(weight, bias, kernels)(x), widened))
        for other in outs[1:]:
            assert torch.equal(outs[0][0], other[0]) and torch.equal(outs[0][1], other[1])


def test_an_instruction_set_this_cpu_lacks_is_an_error_not_a_crash(cache, monkeypatch):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: {"sse2"})
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="CONVEYOR_CPU_ISA=avx512 needs CPU features"):
        cpu_build.build()


# C parameter types as ctypes sees them: any pointer is a void pointer.
_C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}
_C_RESTYPES = {"void": None, "int": ctypes.c_int}
# An exported definition (CONVEYOR_EXPORT, as the preprocessor expands it).
_PROTOTYPE = re.compile(
    r'^__attribute__\(\(visibility\("default"\)\)\)\s+(void|int)\s+(\w+)\s*\(([^)]*)\)\s*\{',
    re.MULTILINE,
)


def _ctype(param: str) -> type:
    if "*" in param:
        return ctypes.c_void_p
    base = param.replace("const", "").split()[0]
    return _C_TYPES[base]


def _c_prototypes() -> dict[str, list[tuple[type | None, list[type]]]]:
    """Every exported definition in csrc/, as the preprocessor expands it (the kernels written
    once per type in a header are defined through macros) for the AVX2 build, the portable
    one and the two AVX-512 ones (a function defined under #ifdef and #else is checked on
    each side)."""
    found: dict[str, list[tuple[type | None, list[type]]]] = {}
    levels = (["-march=x86-64-v3"], ["-march=x86-64"], ["-march=x86-64-v4"])
    for march in (*levels, ["-march=x86-64-v4", "-mavx512bf16"]):
        for src in cpu_build.sources():
            code = subprocess.run(
                [*cpu_build.compiler(), "-E", "-P", "-fopenmp", *march, str(src)],
                capture_output=True, text=True, check=True, timeout=60,
            ).stdout  # fmt: skip
            for ret, name, params in _PROTOTYPE.findall(code):
                plist = [p.strip() for p in params.split(",") if p.strip() not in ("", "void")]
                found.setdefault(name, []).append((_C_RESTYPES[ret], [_ctype(p) for p in plist]))
    return found


@needs_cc
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 flags")
def test_every_ctypes_signature_matches_the_c_definition():
    prototypes = _c_prototypes()
    assert set(prototypes) == set(cpu_kernels.SIGNATURES)  # none missing, none extra
    for name, (argtypes, restype) in cpu_kernels.SIGNATURES.items():
        for c_restype, c_args in prototypes[name]:
            assert len(argtypes) == len(c_args), f"{name}: argument count"
            assert list(argtypes) == c_args, name
            assert restype == c_restype, name


@needs_cc
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 flags")
def test_the_signature_check_catches_a_wrong_argument_count(monkeypatch):
    name = "rotary_f32"
    argtypes, restype = cpu_kernels.SIGNATURES[name]
    monkeypatch.setitem(cpu_kernels.SIGNATURES, name, (argtypes[:-1], restype))
    with pytest.raises(AssertionError, match="rotary_f32: argument count"):
        test_every_ctypes_signature_matches_the_c_definition()


# The structs csrc/kernels.h declares and their ctypes mirrors.
_STRUCTS = {
    "attention_rows": kernel_structs.AttentionRowsC,
    "attention_args": kernel_structs.AttentionArgsC,
    "linear_desc": kernel_structs.LinearDescC,
    "layer_desc": kernel_structs.LayerDescC,
    "step_desc": kernel_structs.StepDescC,
    "moe_args": kernel_structs.MoeArgsC,
}


@needs_cc
def test_every_struct_mirror_has_the_c_layout(tmp_path):
    # A field out of place would hand the kernels another field's bytes, not raise.
    lines = ["#include <stdio.h>", '#include "kernels.h"', "int main(void) {"]
    for name, mirror in _STRUCTS.items():
        lines.append(f'printf("{name} %zu\\n", sizeof({name}));')
        for field, _ in mirror._fields_:
            lines.append(f'printf("{name}.{field} %zu\\n", offsetof({name}, {field}));')
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text("\n".join([*lines, "return 0;", "}"]) + "\n")
    cc = cpu_build.compiler()
    subprocess.run([*cc, "-std=c11", "-I", str(cpu_build.CSRC), str(src), "-o", str(exe)],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    printed = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    c_layout = dict(line.rsplit(" ", 1) for line in printed.splitlines())
    for name, mirror in _STRUCTS.items():
        assert int(c_layout[name]) == ctypes.sizeof(mirror), name
        for field, _ in mirror._fields_:
            assert int(c_layout[f"{name}.{field}"]) == getattr(mirror, field).offset, field


def _check_command(env_overrides: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONVEYOR_CACHE_DIR": str(tmp_path), **env_overrides}
    return subprocess.run(
        [sys.executable, "-m", "conveyor.model.cpu.cpu_kernels"], env=env, capture_output=True,
        text=True, check=False, timeout=300,
    )  # fmt: skip


@needs_cc
def test_the_check_command_says_what_runs_here_and_fails_without_the_kernels(tmp_path):
    # The Dockerfile's build step: an image whose kernels do not load must not build.
    ok = _check_command({"CONVEYOR_CPU_ISA": "portable"}, tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "CPU C kernels: loaded from" in ok.stdout and "instruction set: portable" in ok.stdout
    assert "portable C (auto picks oneDNN)" in ok.stdout
    broken = _check_command({"CC": "false"}, tmp_path / "empty")
    assert broken.returncode == 1
    assert "unavailable" in broken.stdout and "failed" in broken.stderr

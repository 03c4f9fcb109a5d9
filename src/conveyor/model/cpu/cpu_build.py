"""Building the CPU C kernels (csrc/*.c) into one cached shared object.

The library is compiled on first use with the machine's C compiler and kept in
$CONVEYOR_CACHE_DIR (default ~/.cache/conveyor/cpu_kernels) under a name keyed by everything
the object depends on: the sources and headers, the compiler command and its version, the
flags (the instruction set among them) and the CPU. It is written to a temporary name and
renamed, so concurrent processes never load a half-written file, and a digest file beside it
records its SHA-256: a cached object whose bytes do not match (truncated, or another file put
in its place) is rebuilt, never loaded.

The instruction set: by default `-march=native` (what this CPU has). CONVEYOR_CPU_ISA forces a
lower one, for CPUs without AVX2 or to test the portable paths on a machine that has it:

    CONVEYOR_CPU_ISA   x86_64                      aarch64          the GEMM (csrc/gemm_*.c)
    (unset)            -march=native               -march=native    the best this CPU has
    portable           -march=x86-64 (SSE2)        -march=armv8-a   generic C (auto-vectorised)
    avx2               -march=x86-64-v3            (refused)        AVX2 + FMA
    avx512             -march=x86-64-v4            (refused)        AVX-512, bf16 widened
    avx512bf16         -march=x86-64-v4            (refused)        AVX-512, bf16 panels
                       -mavx512bf16                                 through vdpbf16ps

The GGUF dot products (csrc/quant_x8_*.c, quant_k_*.c) take 512-bit registers wherever the
build has AVX-512BW: dpbusd with AVX-512 VNNI (a native build on Zen 4/5, Ice Lake and later),
maddubs without it (the avx512 and avx512bf16 levels), tiles of up to four activation rows
per unpacked weight load; 256-bit maddubs one row at a time at avx2.

Each kernel's variants for an instruction set live in files of their own (quant_k_avx512.c,
gemm_avx2.c, ...), each compiled under its feature macro (csrc/kernels.h says which the flags
allow); the `_generic` fallbacks compile in every build. The library is compiled with
-fvisibility=hidden: its only exported symbols are the CONVEYOR_EXPORT entry points that
cpu_kernels.SIGNATURES binds.

The lower levels let tests run each kernel path on a machine that has a higher one
(tests/model/test_cpu_isa.py); `python -m conveyor.model.cpu.cpu_kernels` says which GEMM a build
has.
Asking for an instruction set this CPU lacks is a ValueError (its code would die on an
illegal instruction), as is an unknown name.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
ISA_ENV = "CONVEYOR_CPU_ISA"
ISAS = ("native", "portable", "avx2", "avx512", "avx512bf16")
_BASE_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-fvisibility=hidden"]
# x86-64 levels (the psABI's): what -march=x86-64-v3 / -v4 let the compiler use, by the names
# /proc/cpuinfo gives those features.
_X86_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_X86_LEVELS = {
    "portable": (["-march=x86-64"], set()),
    "avx2": (["-march=x86-64-v3"], _X86_V3),
    "avx512": (["-march=x86-64-v4"], _X86_V4),
    "avx512bf16": (["-march=x86-64-v4", "-mavx512bf16"], _X86_V4 | {"avx512_bf16"}),
}


def sources() -> list[Path]:
    """The C files compiled into the library."""
    return sorted(CSRC.glob("*.c"))


def headers() -> list[Path]:
    """The headers they include (part of the cache key)."""
    return sorted(CSRC.glob("*.h"))


def cache_dir() -> Path:
    """Where built libraries live: $CONVEYOR_CACHE_DIR, else $XDG_CACHE_HOME or ~/.cache."""
    root = os.environ.get("CONVEYOR_CACHE_DIR")
    if root:
        return Path(root) / "cpu_kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "conveyor" / "cpu_kernels"


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def requested_isa() -> str:
    """The instruction set the kernels are built for: $CONVEYOR_CPU_ISA, else "native".

    Raises:
        ValueError: an unknown name.
    """
    isa = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if isa not in ISAS:
        raise ValueError(
            f"{ISA_ENV} must be one of {', '.join(ISAS[1:])} (or unset for what this CPU has), "
            f"got {os.environ[ISA_ENV]!r}."
        )
    return isa


def isa_flags(isa: str, machine: str | None = None, flags: set[str] | None = None) -> list[str]:
    """The compiler's instruction-set flags for `isa` on `machine` with CPU `flags` (default:
    this machine's).

    Raises:
        ValueError: an instruction set this machine's architecture or CPU does not have.
    """
    machine = (machine or platform.machine()).lower()
    if isa == "native":
        return ["-march=native"]
    if machine in ("x86_64", "amd64"):
        march_flags, needs = _X86_LEVELS[isa]
        missing = sorted(needs - (cpu_flags() if flags is None else flags))
        if missing:
            raise ValueError(
                f"{ISA_ENV}={isa} needs CPU features this CPU lacks ({', '.join(missing)}); "
                "use a lower one (portable runs everywhere) or leave it unset."
            )
        return list(march_flags)
    if isa == "portable":
        return ["-march=armv8-a"] if machine in ("aarch64", "arm64") else []
    raise ValueError(f"{ISA_ENV}={isa} is an x86-64 instruction set; this machine is {machine}.")


def compiler() -> list[str]:
    """The C compiler command, split like a shell would ($CC may be `ccache gcc`).

    Raises:
        RuntimeError: no compiler found.
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc or not shlex.split(cc):
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    return shlex.split(cc)


@functools.cache
def _compiler_version(cc: tuple[str, ...]) -> str:
    """`cc --version`, for the cache key: another gcc builds another library."""
    try:
        res = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot run the C compiler {shlex.join(cc)!r}: {exc}") from exc
    return res.stdout


def build_flags() -> list[str]:
    """Every flag the library is compiled with, the instruction set's included."""
    return [*_BASE_FLAGS, *isa_flags(requested_isa())]


def _run(cmd: list[str]) -> None:
    """Run one compiler command; its failure is a RuntimeError carrying the compiler's words."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot run the C compiler {cmd[0]!r}: {exc}") from exc
    if res.returncode:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed: {res.stderr.strip()[-2000:]}")


def _compile_and_link(cc: list[str], flags: list[str], objs: Path, out: str) -> None:
    """Compile each source to an object in `objs`, as many at once as there are cores (the
    largest first, so the last to finish is a small one), then link them into `out`: a first
    start waits for the longest file, not the sum (docs/kernels.md#measured-choices)."""
    srcs = sources()
    jobs = sorted(srcs, key=lambda src: -src.stat().st_size)
    obj = {src: objs / (src.stem + ".o") for src in srcs}
    # The cores this process may run on (a container's cpuset), not the host's count.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(1, min(len(srcs), cores or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        # list(): every compile's exception surfaces here, the first in size order raised.
        list(pool.map(lambda src: _run([*cc, *flags, "-c", str(src), "-o", str(obj[src])]), jobs))
    _run([*cc, *flags, *(str(obj[src]) for src in srcs), "-o", out, "-lm"])


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(lib: Path) -> bool:
    """Whether `lib` is the object this cache built: its bytes match the digest beside it."""
    digest = lib.with_name(lib.name + ".sha256")
    try:
        return digest.read_text().strip() == _digest(lib)
    except OSError:
        return False


def build() -> Path:
    """Compile the kernels (or find them already built) and return the library's path.

    Raises:
        RuntimeError: no C compiler, or the build failed (with the compiler's message).
        ValueError: CONVEYOR_CPU_ISA names an unknown instruction set or one the CPU lacks.
    """
    cc = compiler()
    flags = build_flags()
    key = hashlib.sha256(b"\0".join(map(str.encode, [*cc, _compiler_version(tuple(cc)), *flags])))
    for src in (*sources(), *headers()):
        key.update(src.name.encode() + b"\0" + src.read_bytes())
    key.update((platform.machine() + " ".join(sorted(cpu_flags()))).encode())
    out_dir = cache_dir()
    lib = out_dir / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if _verified(lib):
        return lib
    # A first start compiles for seconds before anything else is said: say why.
    logger.info("Compiling the CPU C kernels for this CPU (once, then cached: several seconds)")
    start = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    digest_tmp = tmp + ".sha256"
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, suffix=".objs") as objs:
            _compile_and_link(cc, flags, Path(objs), tmp)
        Path(digest_tmp).write_text(_digest(Path(tmp)) + "\n")
        # The object first, then its digest: a reader in between sees a mismatch and builds
        # its own copy (harmless), never a verified half.
        os.replace(tmp, lib)
        os.replace(digest_tmp, lib.with_name(lib.name + ".sha256"))
    finally:
        for path in (tmp, digest_tmp):
            if os.path.exists(path):
                os.unlink(path)
    logger.info("Compiled the CPU C kernels in %.1f s into %s", time.monotonic() - start, lib)
    return lib

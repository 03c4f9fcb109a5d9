"""C kernels for CPU, compiled on first use with the machine's C compiler and called through
ctypes: the paged attention of the "cpu" attention backend (csrc/paged_attention.c), RMSNorm
with its residual add fused in (csrc/rms_norm.c), the rotary embedding in place
(csrc/rotary.c), the gated MLP's silu(gate) * up (csrc/silu_mul.c), the sampler's
row-wise argmax (csrc/argmax.c), the linear layers of linear_backend "cpu" (csrc/gemm.c,
weights packed by conveyor.model.cpu.linear.CpuLinear) and every decoder layer of a step in one
call on those kernels (csrc/decoder_layers.c, wrapped by conveyor.model.cpu.fused_layers).

Why C and not torch: a step's attention in torch must first copy every request's K and V
out of the paged cache into a padded tensor (one gather per layer), then run SDPA on the
copy with a mask (and one SDPA per prefill chunk); the kernel reads each K and V row in
place, for all the query heads that share it, and stops at each row's own context. Why
ctypes and not a torch extension: the source includes no torch header, so it builds in well
under a second and needs nothing but a C compiler (the Dockerfile installs gcc; Triton
needs one at run time too).

The library (every csrc/*.c in one shared object) is built and cached by cpu_build.py, for the
instruction set CONVEYOR_CPU_ISA names (default: what this CPU has). When there is no compiler
or the build fails, `load()` returns None and says why once in the log; callers fall back to
torch. `-fopenmp` links libgomp.so.1, which resolves to the copy torch has already loaded: the
kernels share torch's OpenMP threads instead of starting a second pool.

Every C entry point's ctypes signature is in SIGNATURES, the one table the constructor binds
from, under its C name (csrc/kernels.h: `<op>_<weight type>_<activation type>`, e.g.
gemm_bf16_f32); tests/model/test_cpu_build.py checks it against the C definitions in csrc/ (a wrong
argument count would otherwise corrupt memory, not raise). The attention takes its arguments
as two structs, mirrored in kernel_structs.py.

`python -m conveyor.model.cpu.cpu_kernels` builds and loads them and says what this machine runs
(exit status 1 when they cannot be loaded: the Dockerfile's check).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.model.cpu import cpu_build
from conveyor.model.cpu.kernel_structs import AttentionArgsC, AttentionRowsC

logger = logging.getLogger(__name__)

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_NORM_ARGS = [_P, _I64, _P, _I64, _P, _I64, _I32, _F32, _I32]
_ROTARY_ARGS = [_P, _I64, _I64, _I32, _I32, _P, _P, _I32]
_SILU_MUL_ARGS = [_P, _I64, _P, _I64, _I64, _I32, _I32]
_ARGMAX_ARGS = [_P, _I64, _I64, _I64, _P, _I32]
_GEMM_ARGS = [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I32]
_ROWS_ARGS = [_P, _I64, _I64, _P, _I64, _P, _I64, _I32]
_QUANTIZE_ARGS = [_P, _I64, _I64, _I64, _P, _I32, _I32]
_GEMM_GGUF_Q8A_ARGS = [_I32, _P, _I64, _I64, _I64, _P, _I64, _I32, _P, _P, _I64, _I32, _I32]
_ROWS_GGUF_ARGS = [_I32, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I32]
_GEMM_GGUF_BF16_ARGS = [_I32, _P, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I32]
# Every exported C function (csrc/kernels.h's CONVEYOR_EXPORT entry points, named
# <op>_<weight type>_<activation type>[_<form>]): (argument types, return type).
SIGNATURES: dict[str, tuple[list, type | None]] = {
    # attention_rows *, attention_args * (kernel_structs.py)
    "paged_attention_f32_f32": ([_P, _P], ctypes.c_int),
    "paged_attention_bf16_f32": ([_P, _P], ctypes.c_int),
    "add_rms_norm_f32_f32": (_NORM_ARGS, None),
    "rms_norm_f32_f32": (_NORM_ARGS, None),
    "rotary_f32": (_ROTARY_ARGS, None),
    "silu_mul_f32": (_SILU_MUL_ARGS, None),
    "argmax_f32": (_ARGMAX_ARGS, None),
    "nonfinite_rows_f32": (_ARGMAX_ARGS, ctypes.c_int),
    "gemm_f32_f32": (_GEMM_ARGS, None),
    "gemm_bf16_f32": (_GEMM_ARGS, None),  # bf16 weights widened, x float32
    "gemm_bf16_bf16": (_GEMM_ARGS, None),  # vdpbf16ps, x rounded to bf16
    # bf16 panels one to a group (quant_gemm.c's slices) or PANEL_GROUP to one
    "gemm_bf16_f32_grouped": ([*_GEMM_ARGS, _I32], None),
    "gemm_bf16_bf16_grouped": ([*_GEMM_ARGS, _I32], None),
    "gemm_isa": ([], ctypes.c_int),
    "rows_f32_f32": (_ROWS_ARGS, ctypes.c_int),
    "rows_bf16_f32": (_ROWS_ARGS, ctypes.c_int),
    # GGUF blocks (conveyor.model.cpu.quant_linear wraps them)
    "quantize_q8a_f32": (_QUANTIZE_ARGS, None),
    "gemm_gguf_q8a": (_GEMM_GGUF_Q8A_ARGS, ctypes.c_int),
    "rows_gguf_f32": (_ROWS_GGUF_ARGS, ctypes.c_int),
    "gemm_gguf_bf16": (_GEMM_GGUF_BF16_ARGS, ctypes.c_int),
    # every decoder layer of a step (conveyor.model.cpu.fused_layers wraps it)
    "decoder_layers_f32": ([_P, _I32, *[_P] * 10], ctypes.c_int),
    # a mixture of experts' feed-forward (conveyor.model.cpu.moe_kernel wraps it)
    "moe_f32": ([_P], ctypes.c_int),
}
# The entry points only a build with AVX512-BF16 has (the vdpbf16ps GEMM and the GGUF prefill
# on it): CpuKernels binds them where the library has them.
BUILD_DEPENDENT = frozenset({"gemm_bf16_bf16", "gemm_bf16_bf16_grouped", "gemm_gguf_bf16"})
# Output columns per panel of a packed weight (csrc/gemm_panels.h's NR), and panels per group:
# a group's panels are stored line by line (csrc/gemm_panels.h's PANEL_GROUP).
LINEAR_PANEL = 16
LINEAR_PANEL_GROUP = 4
# The GEMM a build has, by gemm_isa's number (csrc/kernels.h): the generic loop, AVX2 + FMA,
# AVX-512 (bf16 weights widened to float32), AVX-512 with bf16 panels through vdpbf16ps (x
# rounded to bf16).
LINEAR_ISAS = ("portable", "avx2", "avx512", "avx512-bf16")


def _c_rows(x: torch.Tensor) -> bool:
    """Whether the row-wise C loops (argmax, nonfinite_rows) can read x: float32 [N, V] on the
    CPU, unit stride along a row."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and (x.shape[1] <= 1 or x.stride(1) == 1)
    )


class CpuKernels:
    """The loaded library; one method per kernel, each checking what C cannot."""

    def __init__(self, lib: ctypes.CDLL, path: str = "") -> None:
        fns = {}
        for name, (argtypes, restype) in SIGNATURES.items():
            if name in BUILD_DEPENDENT and not hasattr(lib, name):
                continue
            fns[name] = fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._attend = {
            torch.float32: fns["paged_attention_f32_f32"],
            torch.bfloat16: fns["paged_attention_bf16_f32"],
        }
        self._add_norm = fns["add_rms_norm_f32_f32"]
        self._norm = fns["rms_norm_f32_f32"]
        self._rotary = fns["rotary_f32"]
        self._silu_mul = fns["silu_mul_f32"]
        self._argmax = fns["argmax_f32"]
        self._nonfinite_rows = fns["nonfinite_rows_f32"]
        # bf16 panels through vdpbf16ps where the build has it, else widened
        self._linear = {
            torch.float32: fns["gemm_f32_f32"],
            torch.bfloat16: fns.get("gemm_bf16_bf16", fns["gemm_bf16_f32"]),
        }
        self._linear_widened = fns["gemm_bf16_f32"]
        self._linear_rows = {
            torch.float32: fns["rows_f32_f32"],
            torch.bfloat16: fns["rows_bf16_f32"],
        }
        # Which GEMM this build has (LINEAR_ISAS): what -march=native (or CONVEYOR_CPU_ISA)
        # let the compiler use.
        self.linear_isa = LINEAR_ISAS[fns["gemm_isa"]()]
        # Whether the GEMM is a vector kernel, AVX2 + FMA or above (a portable build has a
        # plain C one: correct, but linear_backend "auto" prefers oneDNN to it).
        self.linear_vectorized = self.linear_isa != "portable"
        self.path = path
        self.fns = fns  # every entry point, for modules that wrap their own (quant_linear.py)

    def rotary_step(
        self, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> Callable[[torch.Tensor], None]:
        """A function that rotates x [T, H, D] in place (float32, heads contiguous, any token
        stride) by the rows `positions` (int64 [T]) of cos_sin [max_position, D] ([cos | sin]
        halves). The positions and the table are checked here, once for every layer of a
        step (RopeStep); each call checks only its x.

        Raises:
            ValueError: a position outside the table, or tensors the kernel cannot read.
        """
        t = positions.numel()
        if cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or not cos_sin.is_contiguous():
            raise ValueError("cos_sin must be a contiguous float32 [max_position, D] table.")
        table_len, d = cos_sin.shape
        if d % 2:
            raise ValueError(f"rotary heads must be even-sized, got {d}.")
        if positions.dtype != torch.int64 or positions.shape != (t,) or positions.stride(0) != 1:
            raise ValueError("positions must be a contiguous int64 [T] tensor.")
        if t and not 0 <= int(positions.min()) <= int(positions.max()) < table_len:
            raise ValueError(f"a position is outside the rotary table of {table_len}.")

        def rotate_(x: torch.Tensor) -> None:
            if x.dtype != torch.float32 or x.dim() != 3 or x.shape[0] != t or x.shape[2] != d:
                raise ValueError(f"rotary needs float32 [{t}, H, {d}], got {tuple(x.shape)}.")
            if x.stride(2) != 1 or x.stride(1) != d:
                raise ValueError(f"rotary needs contiguous heads, got strides {x.stride()}.")
            self._rotary(
                x.data_ptr(),
                x.stride(0),
                t,
                x.shape[1],
                d,
                positions.data_ptr(),
                cos_sin.data_ptr(),
                torch.get_num_threads(),
            )

        return rotate_

    def add_rms_norm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """In place: residual += x, then x = rms_norm(residual) * weight (rows of [N, H]).

        The caller checks what C cannot: float32 [N, H] tensors with unit stride along H,
        weight [H] contiguous (RMSNorm.forward does).
        """
        rows, hidden = x.shape
        self._add_norm(
            x.data_ptr(),
            x.stride(0),
            residual.data_ptr(),
            residual.stride(0),
            weight.data_ptr(),
            rows,
            hidden,
            eps,
            torch.get_num_threads(),
        )

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether the norm, rotary and activation kernels take `x`: float32 on the CPU (the
        layers ask before each call; models/layers.py)."""
        return x.dtype == torch.float32 and x.device.type == "cpu"

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up = [gate | up] ([N, 2 I]) as a new [N, I] tensor.

        The caller checks what C cannot: float32 [N, 2 I] with unit stride along the row
        (GatedMLP.forward does).
        """
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self._silu_mul(
            gate_up.data_ptr(),
            gate_up.stride(0),
            out.data_ptr(),
            out.stride(0),
            rows,
            width // 2,
            torch.get_num_threads(),
        )
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) of a [N, V] tensor, the same int64 [N] indices (the first
        maximum; a NaN is the maximum): the C loop for float32 CPU rows with unit stride,
        torch's own argmax for anything else."""
        if not _c_rows(x) or x.shape[1] == 0 or x.shape[1] >= 2**31:
            return x.argmax(dim=-1)
        rows, cols = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax(x.data_ptr(), x.stride(0), rows, cols, out.data_ptr(), torch.get_num_threads())
        return out

    def nonfinite_rows(self, x: torch.Tensor) -> list[int]:
        """The rows of a [N, V] tensor that hold a NaN or an infinity, in order: one C pass for
        float32 CPU rows with unit stride, torch's isfinite for anything else."""
        if not _c_rows(x):
            return (~torch.isfinite(x).all(dim=-1)).nonzero().flatten().tolist()
        rows, cols = x.shape
        bad = torch.empty(rows, dtype=torch.uint8)
        threads = torch.get_num_threads()
        if not self._nonfinite_rows(x.data_ptr(), x.stride(0), rows, cols, bad.data_ptr(), threads):
            return []
        return bad.nonzero().flatten().tolist()

    def linear_rows(self, packed: torch.Tensor, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64, any shape) of the [n, k] weight packed in `packed` (CpuLinear's
        float32 or bf16 panels) as float32 [*ids.shape, k].

        Raises:
            ValueError: an id outside [0, n).
        """
        if packed.dtype not in (torch.float32, torch.bfloat16) or not packed.is_contiguous():
            raise ValueError(
                f"packed panels are contiguous float32 or bfloat16, not {packed.dtype}."
            )
        flat = ids  # a step's token ids already are int64 [T], contiguous
        if ids.dim() != 1 or ids.dtype != torch.int64 or not ids.is_contiguous():
            flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), k, dtype=torch.float32)
        threads = torch.get_num_threads()
        if self._linear_rows[packed.dtype](
            packed.data_ptr(), n, k, flat.data_ptr(), flat.numel(), out.data_ptr(), k, threads
        ):
            raise ValueError(f"a token id is outside the vocabulary [0, {n}).")
        return out if flat is ids else out.view(*ids.shape, k)

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        widened: bool = False,
    ) -> torch.Tensor:
        """x @ W.T + bias as a new float32 [M, n] tensor, W packed as CpuLinear packs it.

        The caller checks what C cannot: x float32 [M, K] with unit stride along K, packed
        the contiguous panels of W (float32 [ceil(n / 16), K, 16] or bfloat16
        [ceil(n / 16), ceil(K / 2), 16, 2]), bias None or float32 [n] contiguous (CpuLinear
        does). `widened`: bf16 panels through the kernel that widens them to float32 and
        leaves x unrounded, also in a build whose default is vdpbf16ps (tests, benchmarks).
        """
        rows, k = x.shape
        out = torch.empty(rows, n, dtype=torch.float32)
        if rows:
            fn = self._linear[packed.dtype]
            if widened and packed.dtype == torch.bfloat16:
                fn = self._linear_widened
            fn(
                x.data_ptr(),
                x.stride(0),
                rows,
                packed.data_ptr(),
                n,
                k,
                None if bias is None else bias.data_ptr(),
                out.data_ptr(),
                n,
                torch.get_num_threads(),
            )
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x) * weight for rows of [N, H] (same preconditions as add_rms_norm_)."""
        rows, hidden = x.shape
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self._norm(
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            weight.data_ptr(),
            rows,
            hidden,
            eps,
            torch.get_num_threads(),
        )
        return out

    def attention_rows(
        self,
        block_tables: torch.Tensor,
        rows: torch.Tensor,
        batch: torch.Tensor,
        key_end: torch.Tensor,
        max_keys: int,
        key_begin: torch.Tensor | None = None,
    ) -> AttentionRows:
        """The query rows of one step's paged attention, checked here once for every layer.

        Args:
            block_tables: int32 [B, max_blocks].
            rows: int64 [n] the query rows to attend; batch: int64 [n] each one's table row.
            key_end: int32 [n] one past each row's last key position (a decode row: its
                context length; a prefill token at position p: p + 1).
            max_keys: >= key_end[i] - key_begin[i] for every i (sizes the work buffers; the
                kernel refuses a row past it).
            key_begin: int32 [n] each row's first key position; None: 0.
        """
        ends = (key_end,) if key_begin is None else (key_end, key_begin)
        if block_tables.dtype != torch.int32 or any(e.dtype != torch.int32 for e in ends):
            raise ValueError("block_tables, key_end and key_begin are int32.")
        if block_tables.dim() != 2 or block_tables.stride(1) != 1:
            raise ValueError("block_tables rows must be contiguous.")
        if (rows.dtype, batch.dtype) != (torch.int64, torch.int64):
            raise ValueError("rows and batch are int64.")
        n = rows.numel()
        if any(x.shape != (n,) or (n and x.stride(0) != 1) for x in (rows, batch, *ends)):
            raise ValueError("rows, batch, key_end and key_begin need one contiguous entry a row.")
        c = AttentionRowsC(
            block_tables=block_tables.data_ptr(),
            bt_stride=block_tables.stride(0),
            key_begin=None if key_begin is None else key_begin.data_ptr(),
            key_end=key_end.data_ptr(),
            rows=rows.data_ptr(),
            batch=batch.data_ptr(),
            n=n,
            max_keys=max_keys,
        )
        return AttentionRows(rows, batch, key_end, key_begin, block_tables, max_keys, c)

    def paged_attention(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        kv_cache: torch.Tensor,
        rows: AttentionRows,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Attention of single query rows over their paged context, written into out; first
        (same call, same threads) the step's new K/V rows into the cache when new_kv is given.

        Args:
            q: float32 [T, Hq, D] (rows contiguous); out: float32 [T, Hq, D], same strides.
            kv_cache: float32 or bfloat16 [2, num_blocks, block_size, Hkv, D], contiguous
                (bf16: read widened to float32, new rows rounded to nearest even).
            rows: which rows attend which keys (attention_rows, once a step).
            new_kv: (k, v, slots): float32 k, v [T', Hkv, D] (heads contiguous, any token
                stride) written at the flat cache slots int64 [T'] before any row attends,
                so the rows see them (a prefill chunk's own keys).
            sinks: float32 [Hq] contiguous, each query head's sink logit in the softmax's
                denominator (gpt-oss); None: none.
        Raises:
            ValueError: tensors that do not fit, a row's key range outside [1, max_keys], or
                a slot outside the cache (the other tokens are still written).
        """
        _, nb, block_size, hkv, d = kv_cache.shape
        _, hq, qd = q.shape
        if q.dtype != torch.float32 or kv_cache.dtype not in self._attend:
            raise ValueError("paged_attention takes float32 q and a float32 or bfloat16 cache.")
        if qd != d or hq % hkv or out.shape != q.shape:
            raise ValueError(
                f"shapes do not fit: q {tuple(q.shape)}, cache {tuple(kv_cache.shape)}."
            )
        for name, x in (("q", q), ("out", out)):
            if x.stride(2) != 1 or x.stride(1) != d:
                raise ValueError(f"{name} needs contiguous heads, got strides {x.stride()}.")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous.")
        if sinks is not None and (
            sinks.dtype != torch.float32 or sinks.shape != (hq,) or not sinks.is_contiguous()
        ):
            raise ValueError(f"sinks must be a contiguous float32 [{hq}] tensor.")
        args = AttentionArgsC(
            q=q.data_ptr(),
            q_stride=q.stride(0),
            out=out.data_ptr(),
            out_stride=out.stride(0),
            k_cache=kv_cache.data_ptr(),
            # V: the second half
            v_cache=kv_cache.data_ptr() + kv_cache.element_size() * kv_cache.stride(0),
            hq=hq,
            hkv=hkv,
            d=d,
            block_size=block_size,
            scale=scale,
            num_threads=torch.get_num_threads(),
            num_slots=nb * block_size,
            sinks=None if sinks is None else sinks.data_ptr(),
        )
        if new_kv is not None:
            k_new, v_new, slots = new_kv
            n_new = slots.numel()
            for name, x in (("k", k_new), ("v", v_new)):
                if x.dtype != torch.float32 or x.shape != (n_new, hkv, d):
                    raise ValueError(f"new {name} must be float32 [{n_new}, {hkv}, {d}].")
                if x.stride(2) != 1 or x.stride(1) != d:
                    raise ValueError(f"new {name} needs contiguous heads, got {x.stride()}.")
            if slots.dtype != torch.int64 or slots.stride(0) != 1:
                raise ValueError("slots must be a contiguous int64 tensor.")
            args.new_k, args.new_k_stride = k_new.data_ptr(), k_new.stride(0)
            args.new_v, args.new_v_stride = v_new.data_ptr(), v_new.stride(0)
            args.slots, args.n_new = slots.data_ptr(), n_new
        failed = self._attend[kv_cache.dtype](ctypes.byref(rows.c), ctypes.byref(args))
        if failed & 4:
            raise ValueError(f"a new token's cache slot is outside [0, {nb * block_size}).")
        if failed & 2:
            raise ValueError(
                f"a row's key range is empty, negative or longer than {rows.max_keys}."
            )
        if failed:
            raise MemoryError("paged_attention could not allocate its work buffers.")


@dataclass(frozen=True, slots=True)
class AttentionRows:
    """One step's attention rows, checked (CpuKernels.attention_rows), and the kernel's
    struct of them; the tensors stay referenced while the pointers are in use."""

    rows: torch.Tensor  # int64 [n]: the query rows the kernel attends
    batch: torch.Tensor  # int64 [n]: each one's request (block table row)
    key_end: torch.Tensor  # int32 [n]: one past its last key position
    key_begin: torch.Tensor | None  # int32 [n]: its first key position (None: 0)
    block_tables: torch.Tensor
    max_keys: int
    c: AttentionRowsC  # the kernel's attention_rows: pointers into the tensors above


@functools.cache
def load() -> CpuKernels | None:
    """The kernels, built on first call (logging which GEMM the build has, once); None (and
    one warning) when they cannot be built.

    Raises:
        ValueError: CONVEYOR_CPU_ISA names an unknown instruction set or one the CPU lacks.
    """
    try:
        path = str(cpu_build.build())
        kernels = CpuKernels(ctypes.CDLL(path), path)
    except (OSError, RuntimeError, AttributeError) as exc:
        logger.warning("CPU C kernels unavailable (%s); attention and norms run in torch.", exc)
        return None
    logger.info("CPU GEMM: %s", kernels.linear_isa)
    return kernels


def main() -> int:
    """Build and load the kernels and print what runs here; 1 when they cannot be loaded."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    kernels = load()
    isa = cpu_build.requested_isa()
    if kernels is None:
        print(f"CPU C kernels: unavailable (CONVEYOR_CPU_ISA={isa}); see the warning above.")
        return 1
    gemm = {
        "portable": "portable C (auto picks oneDNN)",
        "avx2": "AVX2 + FMA",
        "avx512": "AVX-512 (bf16 weights widened to float32)",
        "avx512-bf16": "AVX-512, bf16 weights through vdpbf16ps (x rounded to bf16)",
    }[kernels.linear_isa]
    print(f"CPU C kernels: loaded from {kernels.path}")
    print(f"  instruction set: {isa} ({' '.join(cpu_build.build_flags())})")
    print(f"  GEMM (linear_backend 'cpu'): {kernels.linear_isa}: {gemm}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

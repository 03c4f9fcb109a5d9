"""Weights checked for values that are not finite, as they are loaded.

One NaN or infinity in a linear's weight reaches every token's logits, so a model that loads
it answers nothing but errors (a crafted file with NaN weights, and one with F32 data labelled
BF16, once loaded and then failed every request with a 500). Each tensor is checked once,
from the bytes it is loaded from, and the first bad value is named:

    float tensors (GGUF F32, F16, BF16; safetensors)   every value: its exponent bits are not
                                                        all ones (NaN and +-inf have them)
    GGUF blocks (Q4_0 ... Q6_K)                         every block's float16 scale (and min):
                                                        the quants are integers, finite as
                                                        long as what multiplies them is
    MXFP4 (GGUF blocks, HF checkpoints' experts)        every E8M0 scale byte: not 0xFF (its
                                                        NaN), and not so large (2^126 and up)
                                                        that a value of its group times it
                                                        overflows float32

A test of the exponent bits on integer views, a million values at a time: about a
nanosecond a value or less (docs/benchmarks.md), a small share of a load that copies every
byte.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from conveyor.model.loading.gguf_file import GGUFTensor

_CHUNK = 1 << 20  # values per test: bounds the temporary arrays
# A float dtype's bit width -> (unsigned integer view, exponent mask).
_EXPONENTS = {
    16: (np.uint16, 0x7C00),  # float16
    32: (np.uint32, 0x7F800000),
    64: (np.uint64, 0x7FF0000000000000),
}
_BF16_EXPONENT = 0x7F80
# GGUF block types: (bytes a block, offsets of its float16 fields: d, and m / dmin where the
# type has one). The other bytes are integer quants and integer sub-scales.
BLOCK_SCALES = {
    "Q8_0": (34, (0,)),
    "Q4_0": (18, (0,)),
    "Q4_1": (20, (0, 2)),
    "Q5_0": (22, (0,)),
    "Q5_1": (24, (0, 2)),
    "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)),
    "Q6_K": (210, (208,)),
}
_FLOAT16_HIGH_EXPONENT = 0x7C  # a little-endian float16's exponent, in its second byte
_E8M0_NAN, _E8M0_HUGE = 0xFF, 253  # the NaN byte; 2^126, the first that a value can overflow
# MXFP4's E2M1 magnitude of each 4-bit code.
_FP4_MAGNITUDES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6] * 2)


def first_bad_e8m0(scales: np.ndarray, codes: np.ndarray) -> tuple[int, int] | None:
    """(index, scale byte) of the first MXFP4 group whose scale is E8M0's NaN or makes one of
    its values overflow float32 (None: none). scales: uint8 [N]; codes: uint8 [N, 16], the
    group's nibbles in either order. Only the rare groups of a huge scale are decoded."""
    huge = np.flatnonzero(scales >= _E8M0_HUGE)
    if huge.size == 0:
        return None
    packed = codes[huge]
    largest = _FP4_MAGNITUDES[np.concatenate([packed & 15, packed >> 4], axis=1)].max(axis=1)
    exponent = scales[huge].astype(np.float64) - 127
    bad = (scales[huge] == _E8M0_NAN) | (largest * np.exp2(exponent) >= 2.0**128)
    if not bad.any():
        return None
    at = int(huge[np.argmax(bad)])
    return at, int(scales[at])


def describe_e8m0(scale: int) -> str:
    """first_bad_e8m0's scale byte, for a message."""
    if scale == _E8M0_NAN:
        return "the E8M0 NaN (0xFF)"
    return f"the scale 2^{scale - 127}, which takes its group's weights past float32's range"


def first_all_ones(bits: np.ndarray, mask: int) -> tuple[int, ...] | None:
    """The index of the first element of the unsigned integer array `bits` whose `mask` bits
    are all set (None: none), tested along the first axis a chunk at a time."""
    if bits.size == 0:
        return None
    per_row = bits.size // bits.shape[0]
    step = max(1, _CHUNK // max(per_row, 1))
    m = bits.dtype.type(mask)
    for start in range(0, bits.shape[0], step):
        chunk = bits[start : start + step]
        hit = (chunk & m) == m
        if hit.any():
            where = np.unravel_index(int(np.argmax(hit)), hit.shape)
            return (start + int(where[0]), *(int(i) for i in where[1:]))
    return None


def _bad_value(kind: str, bits: int) -> str:
    if kind == "BF16":
        value = float(np.array([bits << 16], np.uint32).view(np.float32)[0])
    else:
        width = {"F16": 16, "F32": 32, "F64": 64}[kind]
        dtype = {16: np.float16, 32: np.float32, 64: np.float64}[width]
        value = float(np.array([bits], _EXPONENTS[width][0]).view(dtype)[0])
    return str(value)


def _refusal(where: str, name: str, kind: str, value: str, at: tuple[int, ...]) -> ValueError:
    return ValueError(
        f"{where}tensor {name} ({kind}) holds {value} at {list(at)}; a model with a value "
        "that is not finite answers only errors. The file is damaged, or its tensor types "
        "are mislabelled."
    )


def check_float_bits(where: str, name: str, kind: str, values: np.ndarray) -> None:
    """Raise ValueError naming the first NaN or infinity of `values`.

    Args:
        where: the message's prefix (e.g. "GGUF file x.gguf: ").
        kind: F16, F32, F64 (values of that float type), or BF16 (uint16 bit patterns).
    """
    values = values.reshape(1) if values.ndim == 0 else values
    if kind == "BF16":
        bits, mask = values.view(np.uint16), _BF16_EXPONENT
    else:
        view, mask = _EXPONENTS[values.dtype.itemsize * 8]
        bits = values.view(view)
    at = first_all_ones(bits, mask)
    if at is not None:
        raise _refusal(where, name, kind, _bad_value(kind, int(bits[at])), at)


def check_gguf_tensor(file: str | os.PathLike[str], tensor: GGUFTensor) -> None:
    """Raise ValueError (one line) for a GGUF tensor holding a value that is not finite: a
    float one's values, a block type's float16 scales."""
    kind, where = tensor.tensor_type.name, f"GGUF file {file}: "
    if kind in ("F32", "F16", "BF16"):
        check_float_bits(where, tensor.name, kind, tensor.data)
        return
    if kind == "MXFP4":  # blocks of an E8M0 scale byte and 16 bytes of nibbles
        blocks = tensor.data.reshape(-1, tensor.data.shape[-1] // 17, 17)
        bad = first_bad_e8m0(blocks[..., 0].reshape(-1), blocks[..., 1:].reshape(-1, 16))
        if bad is not None:
            row, block = divmod(bad[0], blocks.shape[1])
            raise ValueError(
                f"{where}tensor {tensor.name} (MXFP4) has a block holding "
                f"{describe_e8m0(bad[1])} (row {row}, block {block}); a model with a value "
                "that is not finite answers only errors. The file is damaged."
            )
        return
    if kind not in BLOCK_SCALES:
        raise ValueError(f"{where}tensor {tensor.name} is {kind}, whose scales are unknown.")
    size, offsets = BLOCK_SCALES[kind]
    blocks = tensor.data.reshape(-1, tensor.data.shape[-1] // size, size)
    for offset in offsets:
        at = first_all_ones(blocks[:, :, offset + 1], _FLOAT16_HIGH_EXPONENT)
        if at is None:
            continue
        row, block = at
        raw = blocks[row, block, offset : offset + 2].copy().view(np.float16)[0]
        field = "scale" if offset == offsets[0] else "min"
        raise ValueError(
            f"{where}tensor {tensor.name} ({kind}) has a block {field} of {float(raw)} (row "
            f"{row}, block {block}); a model with a value that is not finite answers only "
            "errors. The file is damaged, or its tensor types are mislabelled."
        )


def check_torch_tensor(name: str, tensor: Any) -> None:
    """Raise ValueError (one line) for a floating-point CPU torch tensor (a safetensors
    checkpoint's weight) holding a value that is not finite."""
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype == torch.bfloat16:
        bits = tensor.view(torch.int16).numpy().view(np.uint16)
        at = first_all_ones(bits, _BF16_EXPONENT)
        value = None if at is None else _bad_value("BF16", int(bits[at]))
    else:
        width = tensor.element_size() * 8
        if width not in _EXPONENTS:  # float8 types: no infinities to speak of
            return
        view, mask = _EXPONENTS[width]
        ints = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
        bits = tensor.view(ints).numpy().view(view)
        at = first_all_ones(bits, mask)
        value = None if at is None else _bad_value(f"F{width}", int(bits[at]))
    if at is not None:
        raise _refusal("", name, dtype, value, at)

"""A GGUF file's metadata and tensor table, parsed from a memory map in one pass.

`gguf.GGUFReader` builds numpy views for every element of every metadata array, which takes
seconds for a 50k-token vocabulary (and is paid again by each reader); this parser reads the
same layout with `struct` and `np.frombuffer`, in tens of milliseconds. Types, block sizes and
the byte shapes of quantized tensors come from the `gguf` library, whose `dequantize` then
reads the tensors. Layout (little-endian, GGUF v2/v3):

    "GGUF" u32 version, u64 tensor_count, u64 kv_count
    kv_count x (string key, u32 value_type, value)        string = u64 length + UTF-8 bytes
    tensor_count x (string name, u32 n_dims, n_dims x u64 dims, u32 ggml_type, u64 offset)
    padding to general.alignment (32), then the tensor data (offsets are relative to it)
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (outermost first), e.g. (out_features, in_features)
    data: np.ndarray  # read-only view of the file: float32/float16, or uint8 bytes per row
    offset: int  # where its bytes start in the file


class GGUFFile:
    """`metadata` {key: value} (arrays as lists, or numpy arrays for numbers) and `tensors`.

    Every count, length, type and offset read from the file is checked against the bytes
    that are left before anything is read or allocated for it, so a truncated or hostile
    file fails in one clear line (ValueError) instead of a numpy or codec error.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self._parse()
        except struct.error:  # only _unpack reads past _need's checks: the end of the file
            raise ValueError(
                f"cannot read GGUF file {path}: it ends at byte {len(self._map)}, inside its "
                "header (truncated?)"
            ) from None
        except ValueError as exc:
            raise ValueError(f"cannot read GGUF file {path}: {exc}") from None

    def _parse(self) -> None:
        if self._map[:4] != b"GGUF":
            raise ValueError("it does not start with b'GGUF'")
        self._pos = 4
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (conveyor reads versions 2 and 3)")
        # The smallest entries: a key (8-byte length), its type (4) and a 1-byte value; a
        # tensor's name length, n_dims, one dim, its type and offset (8 + 4 + 8 + 4 + 8).
        self._need(n_kv * 13, f"{n_kv} metadata entries")
        self._need(n_tensors * 32, f"{n_tensors} tensor entries")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = self._string(f"metadata key #{i}")
            self.metadata[key] = self._value(self._value_type(key), key)
        infos = [self._tensor_info(i) for i in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", 32)
        if (
            isinstance(alignment, bool)
            or not isinstance(alignment, int)
            or alignment < 1
            or alignment & (alignment - 1)
        ):
            raise ValueError(f"general.alignment is {alignment!r}; it must be a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _tensor_info(self, i: int) -> tuple[str, list[int], GGMLQuantizationType, int]:
        name = self._string(f"the name of tensor #{i}")
        n_dims = self._unpack("<I")
        if not 1 <= n_dims <= 4:  # GGML_MAX_DIMS
            raise ValueError(f"tensor {name} has {n_dims} dimensions; GGUF allows 1 to 4")
        dims = [self._unpack("<Q") for _ in range(n_dims)]
        if min(dims) < 1:
            raise ValueError(f"tensor {name} has dimensions {dims}; each must be at least 1")
        raw_type = self._unpack("<I")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name} has unknown ggml type {raw_type}") from None
        return name, dims, qtype, self._unpack("<Q")

    def _tensor(
        self, start: int, name: str, dims: list[int], qtype: GGMLQuantizationType, offset: int
    ) -> GGUFTensor:
        shape = tuple(reversed(dims))  # GGUF lists the innermost dimension first
        count = math.prod(shape)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise ValueError(
                f"tensor {name} ({qtype.name}) has rows of {dims[0]} values, not a multiple of "
                f"its block size {block}"
            )
        nbytes = count // block * type_size
        if start + offset + nbytes > len(self._map):
            raise ValueError(
                f"tensor {name} {list(shape)} ({qtype.name}, {nbytes} bytes at offset {offset}) "
                f"runs past the end of the file (truncated?)"
            )
        if qtype in _TYPED:
            data = np.frombuffer(self._map, _TYPED[qtype], count, start + offset).reshape(shape)
        else:
            data = np.frombuffer(self._map, np.uint8, nbytes, start + offset)
            data = data.reshape(quant_shape_to_byte_shape(shape, qtype))
        return GGUFTensor(name, qtype, shape, data, start + offset)

    def drop_pages(self, tensor: GGUFTensor) -> None:
        """Take `tensor`'s pages out of this process's resident set, once its bytes were
        copied (the page cache keeps them: reading the view again faults them back in).
        Without this the whole file ends up resident on top of the loaded weights by the end
        of a load (docs/benchmarks.md#against-llamacpp-on-the-same-gguf-file)."""
        if not hasattr(mmap, "MADV_DONTNEED"):  # not Linux / macOS
            return
        start = tensor.offset - tensor.offset % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, tensor.offset + tensor.data.nbytes - start)

    def _need(self, nbytes: int, what: str) -> None:
        """Raise unless `nbytes` more bytes follow the read position."""
        left = len(self._map) - self._pos
        if nbytes > left:
            raise ValueError(
                f"{what} at byte {self._pos} need {nbytes} bytes, but the file has {left} "
                "left (truncated?)"
            )

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self, what: str) -> str:
        n = self._unpack("<Q")
        self._need(n, what)
        start = self._pos
        try:
            text = self._map[start : start + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = self._map[start + exc.start]
            raise ValueError(
                f"{what} is not valid UTF-8 (byte 0x{bad:02x} at file offset {start + exc.start})"
            ) from None
        self._pos += n
        return text

    def _value_type(self, key: str) -> GGUFValueType:
        raw = self._unpack("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"metadata {key} has unknown value type {raw}") from None

    def _value(self, vtype: GGUFValueType, key: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string(f"the value of {key}")
        if vtype != GGUFValueType.ARRAY:
            return self._unpack(_SCALARS[vtype])
        item, count = self._value_type(key), self._unpack("<Q")
        if item in _SCALARS:  # numbers in one read
            dtype = np.dtype(_SCALARS[item])
            self._need(dtype.itemsize * count, f"the {count} {item.name} values of {key}")
            values = np.frombuffer(self._map, dtype, count, self._pos)
            self._pos += dtype.itemsize * count
            return values
        # Strings take at least their 8-byte length, arrays their type and count (12).
        self._need(
            count * (8 if item == GGUFValueType.STRING else 12), f"the {count} values of {key}"
        )
        return [self._value(item, f"{key}[{i}]") for i in range(count)]

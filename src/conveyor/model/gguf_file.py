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


class GGUFFile:
    """`metadata` {key: value} (arrays as lists, or numpy arrays for numbers) and `tensors`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, ValueError, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"cannot read GGUF file {path}: {exc}") from None

    def _parse(self) -> None:
        if self._map[:4] != b"GGUF":
            raise ValueError("it does not start with b'GGUF'")
        self._pos = 4
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (conveyor reads versions 2 and 3)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(GGUFValueType(self._unpack("<I")))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            infos.append((name, dims, GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _tensor(
        self, start: int, name: str, dims: list[int], qtype: GGMLQuantizationType, offset: int
    ) -> GGUFTensor:
        shape = tuple(reversed(dims))  # GGUF lists the innermost dimension first
        count = int(np.prod(shape)) if shape else 1
        block, type_size = GGML_QUANT_SIZES[qtype]
        nbytes = count // block * type_size
        if start + offset + nbytes > len(self._map):
            raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
        if qtype in _TYPED:
            data = np.frombuffer(self._map, _TYPED[qtype], count, start + offset).reshape(shape)
        else:
            data = np.frombuffer(self._map, np.uint8, nbytes, start + offset)
            data = data.reshape(quant_shape_to_byte_shape(shape, qtype))
        return GGUFTensor(name, qtype, shape, data)

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        text = self._map[self._pos : self._pos + n].decode("utf-8")
        self._pos += n
        return text

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype != GGUFValueType.ARRAY:
            return self._unpack(_SCALARS[vtype])
        item, count = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
        if item in _SCALARS:  # numbers in one read
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self._map, dtype, count, self._pos)
            self._pos += dtype.itemsize * count
            return values
        return [self._value(item) for _ in range(count)]

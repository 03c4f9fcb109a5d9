"""safetensors files read as views of a memory map, so loading keeps one copy of the weights.

`safe_open(...).get_tensor` copies each tensor out of the file; the loader then converts or
concatenates it, and the file's pages stay mapped while the file is open: up to ~2x the
weights in RSS. Here each tensor is a view of a private (copy-on-write) map of the file:

- a tensor used as is (same dtype, on CPU) becomes the parameter: its pages are the only copy;
- one that is converted, moved to another device or concatenated into a fused weight is
  `release`d once the new tensor exists: its pages are dropped from the process (MADV_DONTNEED;
  the page cache keeps them for the next load).

Layout: u64 little-endian header size, a JSON header {name: {dtype, shape, data_offsets}},
then the data (offsets relative to its start).
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_PAGE = mmap.PAGESIZE


@dataclass(slots=True)
class MappedTensor:
    """A tensor of a mapped file and the byte range it occupies in the map."""

    tensor: torch.Tensor
    _map: mmap.mmap
    _start: int
    _end: int

    def release(self) -> None:
        """Drop this tensor's pages from the process (call when it has been copied: the
        tensor must not be read afterwards). Only whole pages inside its range go."""
        first = -(-self._start // _PAGE) * _PAGE
        last = self._end // _PAGE * _PAGE
        if last > first and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)


def iter_mapped_tensors(file: Path) -> Iterator[tuple[str, MappedTensor]]:
    """(name, MappedTensor) for every tensor of one safetensors file, in file order."""
    with open(file, "rb") as f:
        # ACCESS_COPY: a private mapping, writable (torch wants writable buffers) without ever
        # writing to the file.
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    (header_len,) = struct.unpack_from("<Q", mm, 0)
    header = json.loads(mm[8 : 8 + header_len])
    header.pop("__metadata__", None)
    base = 8 + header_len
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    for name, info in entries:
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}, not supported.")
        dtype = _DTYPES[info["dtype"]]
        start, end = (base + o for o in info["data_offsets"])
        count = (end - start) // dtype.itemsize
        if count == 0:
            tensor = torch.empty(info["shape"], dtype=dtype)
        elif start % dtype.itemsize:  # misaligned for its dtype: copy it out instead
            tensor = torch.frombuffer(bytearray(mm[start:end]), dtype=dtype).view(info["shape"])
        else:
            tensor = torch.frombuffer(mm, dtype=dtype, count=count, offset=start)
            tensor = tensor.view(info["shape"])
        yield name, MappedTensor(tensor, mm, start, end)

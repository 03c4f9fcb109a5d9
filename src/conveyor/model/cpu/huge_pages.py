"""Weights and the KV cache on 2 MiB pages: fewer TLB misses while a step streams them.

A decode step reads every weight once, front to back, and KV blocks all over the cache. On
4 KiB pages that is a page-table walk every 4 KiB; on the 2 MiB pages of transparent huge
pages (THP) one every 2 MiB. Most kernels are configured "madvise": only memory that asks
(madvise(MADV_HUGEPAGE)) gets them, and a region uses them only in the whole, 2 MiB-aligned
pieces it spans, so a weight smaller than 2 MiB (most of a small model's) gets none in an
allocation of its own.

So the loader gives the weights the C kernels stream (CpuLinear's packed panels, QuantLinear's
interleaved blocks) an arena for the length of the load (`huge_page_arena()`), and the KV
cache allocation one of its own: private anonymous mappings of ARENA_CHUNK bytes that ask for
huge pages, each tensor placed after the previous one (64-byte aligned, as the kernels' loads
want). A tensor larger than a chunk gets a mapping of its own. The mappings live as long as
a tensor in them does.

Measured: docs/kernels.md#measured-choices. $CONVEYOR_HUGE_PAGES=0 turns it off. Where
the kernel has no THP or refuses the advice, the same mappings work on 4 KiB pages; where
Python's mmap has no MADV_HUGEPAGE (not Linux), arena_empty is torch.empty.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import mmap
import os
from collections.abc import Iterator, Sequence

import torch

logger = logging.getLogger(__name__)

ARENA_CHUNK = 256 << 20  # bytes a mapping holds, unless one tensor needs more
ENV = "CONVEYOR_HUGE_PAGES"  # "0": tensors where torch puts them (4 KiB pages here)
ALIGN = 64  # a tensor's first byte: a cache line's

_arena: contextvars.ContextVar[HugePageArena | None] = contextvars.ContextVar(
    "conveyor_huge_page_arena", default=None
)


def supported() -> bool:
    """Whether huge_page_arena opens one: this platform's mmap can ask for huge pages (Linux)
    and $CONVEYOR_HUGE_PAGES is not "0"."""
    if os.environ.get(ENV, "1").strip() == "0":
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


class HugePageArena:
    """A bump allocator over private anonymous mappings that ask for 2 MiB pages."""

    def __init__(self, chunk_bytes: int = ARENA_CHUNK) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8 over the current mapping
        self._used = 0
        self.mapped_bytes = 0  # all mappings' sizes, for the log
        self.placed_bytes = 0  # the tensors' bytes

    def place(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous CPU tensor, placed in the arena."""
        nbytes = _numel(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        start = -(-self._used // ALIGN) * ALIGN
        if self._chunk is None or start + nbytes > self._chunk.numel():
            if nbytes > self.chunk_bytes:  # its own mapping; the current chunk stays open
                self.mapped_bytes += nbytes
                self.placed_bytes += nbytes
                return _view(_mapping(nbytes), 0, nbytes, shape, dtype)
            self._chunk, start = _mapping(self.chunk_bytes), 0
            self.mapped_bytes += self.chunk_bytes
        self._used = start + nbytes
        self.placed_bytes += nbytes
        return _view(self._chunk, start, nbytes, shape, dtype)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _mapping(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] over a new private anonymous mapping advised MADV_HUGEPAGE; the
    tensor keeps the mapping alive."""
    region = mmap.mmap(
        -1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )  # fmt: skip
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError as e:  # THP compiled out or disabled: 4 KiB pages, still correct
        logger.debug("madvise(MADV_HUGEPAGE) refused (%s): 4 KiB pages.", e)
    return torch.frombuffer(region, dtype=torch.uint8)


def _view(
    chunk: torch.Tensor, start: int, nbytes: int, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    return chunk[start : start + nbytes].view(dtype).view(tuple(shape))


@contextlib.contextmanager
def huge_page_arena(chunk_bytes: int = ARENA_CHUNK) -> Iterator[HugePageArena | None]:
    """Within: arena_empty places tensors in one arena (None where not supported), in
    mappings of `chunk_bytes` (the total, where the caller knows it: no gaps between them)."""
    if not supported():
        yield None
        return
    arena = HugePageArena(chunk_bytes)
    token = _arena.set(arena)
    try:
        yield arena
    finally:
        _arena.reset(token)
        if arena.placed_bytes:
            logger.debug(
                "On huge pages: %.1f MiB placed in %.1f MiB of mappings.",
                arena.placed_bytes / 2**20, arena.mapped_bytes / 2**20,
            )  # fmt: skip


def arena_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) on the CPU, in the arena of huge_page_arena()
    when one is open."""
    arena = _arena.get()
    if arena is None:
        return torch.empty(tuple(shape), dtype=dtype)
    return arena.place(shape, dtype)


def huge_page_bytes() -> int | None:
    """This process's resident anonymous memory on huge pages (AnonHugePages of
    /proc/self/smaps_rollup), or None where the file is not there."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

"""release_freed_memory gives the free pages in the middle of glibc's heap back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from conveyor.heap import _malloc_trim, release_freed_memory


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(_malloc_trim() is None, reason="not glibc: no malloc_trim")
def test_free_pages_inside_the_heap_stop_being_resident():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    size, count = 4000, 40_000  # 160 MB of blocks below the mmap threshold: in the heap
    blocks = [libc.malloc(size) for _ in range(count)]
    assert all(blocks)
    for p in blocks:
        ctypes.memset(p, 1, size)  # resident
    kept = blocks[::64]  # every 64th stays: the freed pages lie between them, not at the top
    for i, p in enumerate(blocks):
        if i % 64:
            libc.free(p)
    try:
        before = _rss_anon_mib()
        assert release_freed_memory() is True
        after = _rss_anon_mib()
        assert before - after > 80, (before, after)  # most of the ~157 MB freed
    finally:
        for p in kept:
            libc.free(p)


def test_without_glibc_it_does_nothing(monkeypatch):
    monkeypatch.setattr("conveyor.heap._malloc_trim", lambda: None)
    assert release_freed_memory() is False

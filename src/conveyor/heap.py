"""Giving the heap's freed pages back to the operating system once start-up is over.

Loading a model and building a tokenizer make many short-lived objects: a GGUF file's
metadata arrays and token lists, the conversions of its tensors, the tokenizer's vocabulary
and merges as Python strings. glibc keeps the memory they freed in its heap for later
allocations, so it stays resident: tens of MiB a process (docs/kernels.md#measured-choices).
malloc_trim(0) returns the free pages inside the heap, not just its top.
The server calls this once each process is built (server/launch.py, entrypoints/engine_child.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library, or none found)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim(0)).

    Returns:
        True if glibc released some memory, False if it had none to release or this C
        library has no malloc_trim.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    released = bool(trim(0))
    logger.debug("malloc_trim(0): %s", "released memory" if released else "nothing to release")
    return released

"""Text work of requests (tokenizing, chat templates, long detokenizing) off the event loop.

The event loop streams every request's tokens and answers /health; a 9 MB prompt tokenized on
it, or a slow chat template, would hold all of them up. Such work runs in a small thread pool
of its own instead (not the loop's default executor, which shutdown needs). Short texts stay
inline: below `INLINE_CHARS` characters or `INLINE_TOKENS` tokens the hop to a thread costs
more than the work.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

INLINE_CHARS = 2048
INLINE_TOKENS = 2048

_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        workers = max(2, min(4, os.cpu_count() or 1))
        _executor = ThreadPoolExecutor(workers, thread_name_prefix="conveyor-text")
    return _executor


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in the text pool; the caller's loop serves others meanwhile."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), functools.partial(fn, *args, **kwargs))


async def maybe_off_loop(size: int, limit: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` inline when `size` is below `limit`, else in the text pool."""
    if size < limit:
        return fn(*args)
    return await off_loop(fn, *args)

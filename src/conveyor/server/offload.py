"""Text work of requests (tokenizing, chat templates, long detokenizing) off the event loop.

The event loop streams every request's tokens and answers /health; a 9 MB prompt tokenized on
it, or a slow chat template, would hold all of them up. Such work runs in a small thread pool
of its own instead (not the loop's default executor, which shutdown needs). Short texts stay
inline: below `INLINE_CHARS` characters or `INLINE_TOKENS` tokens the hop to a thread costs
more than the work.

Checking output constraints (compiling a schema to a grammar) runs in a pool of its own,
`schema_pool` (one thread): schemas are a client's to choose, and however many arrive they
queue behind one another, never in front of another request's chat template or tokenizing
(twenty 2.5 s schemas in the shared pool once held a one-token chat request for 48 s).
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
_schema_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        workers = max(2, min(4, os.cpu_count() or 1))
        _executor = ThreadPoolExecutor(workers, thread_name_prefix="conveyor-text")
    return _executor


def schema_pool() -> ThreadPoolExecutor:
    """The pool that checks output constraints (see the module docstring)."""
    global _schema_executor
    if _schema_executor is None:
        _schema_executor = ThreadPoolExecutor(1, thread_name_prefix="conveyor-schema")
    return _schema_executor


async def off_loop(
    fn: Callable[..., T], *args: Any, pool: ThreadPoolExecutor | None = None, **kwargs: Any
) -> T:
    """`fn(*args, **kwargs)` in `pool` (default: the text pool); the caller's loop serves
    others meanwhile."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool or _pool(), functools.partial(fn, *args, **kwargs))


async def maybe_off_loop(size: int, limit: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` inline when `size` is below `limit`, else in the text pool."""
    if size < limit:
        return fn(*args)
    return await off_loop(fn, *args)

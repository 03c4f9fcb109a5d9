"""Text work of requests (tokenizing, chat templates, long detokenizing) off the event loop.

The event loop streams every request's tokens and answers /health; a 9 MB prompt tokenized on
it, or a slow chat template, would hold all of them up. Such work runs in thread pools of its
own instead (not the loop's default executor, which shutdown needs). Short texts stay inline:
below `INLINE_CHARS` characters or `INLINE_TOKENS` tokens the hop to a thread costs more than
the work.

Two lanes, so cheap work never queues behind expensive work (in one first-come pool a few
clients' large renders held every one-message chat for seconds; docs/benchmarks.md):

    light   work up to LIGHT_FACTOR times the inline size (a few milliseconds each): one
            thread of its own, first come first served
    heavy   anything larger, and every render whose cost is unknown (a request's own chat
            template): a small pool, first come first served

Heavy work still shares the CPU with light work (jinja holds the GIL only between bytecodes,
and the tokenizers release it), so a light request waits for its own turn, never for a heavy
request's whole render.

Checking output constraints (compiling a schema to a grammar) runs in a pool of its own,
`schema_pool` (one thread): schemas are a client's to choose, and however many arrive they
queue behind one another, never in front of another request's chat template or tokenizing
(in the shared pool, twenty schemas once held a one-token chat request for most of a minute:
docs/benchmarks.md#structured-output-attacks).
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
LIGHT_FACTOR = 8

_executor: ThreadPoolExecutor | None = None
_light_executor: ThreadPoolExecutor | None = None
_schema_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        workers = max(2, min(4, os.cpu_count() or 1))
        _executor = ThreadPoolExecutor(workers, thread_name_prefix="conveyor-text")
    return _executor


def _light_pool() -> ThreadPoolExecutor:
    global _light_executor
    if _light_executor is None:
        _light_executor = ThreadPoolExecutor(1, thread_name_prefix="conveyor-text-light")
    return _light_executor


def text_pool(size: int | None, inline: int = INLINE_CHARS) -> ThreadPoolExecutor:
    """The lane for text work of `size` (characters, or tokens with inline=INLINE_TOKENS):
    light up to LIGHT_FACTOR * inline, else heavy; None (cost unknown) is heavy."""
    if size is not None and size <= LIGHT_FACTOR * inline:
        return _light_pool()
    return _pool()


def schema_pool() -> ThreadPoolExecutor:
    """The pool that checks output constraints (see the module docstring)."""
    global _schema_executor
    if _schema_executor is None:
        _schema_executor = ThreadPoolExecutor(1, thread_name_prefix="conveyor-schema")
    return _schema_executor


async def off_loop(
    fn: Callable[..., T], *args: Any, pool: ThreadPoolExecutor | None = None, **kwargs: Any
) -> T:
    """`fn(*args, **kwargs)` in `pool` (default: the heavy text lane); the caller's loop serves
    others meanwhile."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool or _pool(), functools.partial(fn, *args, **kwargs))


async def maybe_off_loop(size: int, limit: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` inline when `size` is below `limit`, else in the lane for its size."""
    if size < limit:
        return fn(*args)
    return await off_loop(fn, *args, pool=text_pool(size, limit))

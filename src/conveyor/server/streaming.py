"""Server-sent events, merging the streams of a multi-prompt request, and cancellation.

SSE framing as OpenAI and vLLM send it: every event is `data: {json}\\n\\n`, an error after the
stream started is one `data: {"error": ...}` event, and `data: [DONE]\\n\\n` is always last.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from conveyor.server.errors import sse_error

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(chunk: BaseModel) -> str:
    """One SSE event; unset fields are left out, as vLLM does."""
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def sse_response(events: AsyncIterator[str], done: bool = True) -> StreamingResponse:
    """Stream `events`; an exception becomes an error event, and [DONE] always ends it
    (unless `done` is false: /v1/responses ends with its own last event, as OpenAI's does).

    Events are encoded to UTF-8 here, inside the `try`, rather than by Starlette after it: a
    string that cannot be encoded (a lone surrogate, which `json` lets through into the fast
    events of server/sse.py) then ends the stream with an error event too.
    """

    async def framed() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event.encode()
        except Exception as exc:
            yield sse_error(exc).encode()
        # A client that goes away cancels this task (Starlette listens for the disconnect);
        # the CancelledError runs down into AsyncLLM's stream, which aborts the request.
        if done:
            yield DONE.encode()

    return StreamingResponse(framed(), media_type="text/event-stream")


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive, tagging each with its index.

    Leaving early (or cancellation) closes every stream, which aborts its request.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:
            await queue.put((-1, exc))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            i, item = entry
            if i < 0:
                raise item  # type: ignore[misc]
            yield i, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run a handler, cancelling it if the client disconnects first (vLLM's
    `with_cancellation`): a non-streaming request's generation is aborted, not finished
    for nobody."""
    handler = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([handler, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():  # the client left (or this task was cancelled)
            handler.cancel()
        for task in (watcher, handler):
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if handler.cancelled():
        return Response(status_code=499)  # nobody reads it: the client is gone
    return handler.result()

"""A minimal HTTP/1.1 client on asyncio streams, for `conveyor bench serve`.

A general-purpose client (httpx) spends several times the server's own CPU per streamed chunk;
on a small machine, where client and server share the cores, the benchmark would then measure
itself. This one does only what the benchmark needs: plain http, one request per connection
(`Connection: close`), a JSON body, and a response with Content-Length or chunked:

    async with request(base_url, "GET", "/v1/models") as resp: await resp.json()
    status, error_body = await stream_events(base_url, "/v1/completions", body, on_event)

`stream_events` parses the server-sent events in the transport's callback, with no await per
event, and calls `on_event(payload)` with each `data:` payload as it arrives.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit


class Response:
    """Status, lower-cased headers, and the body still to be read."""

    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader):
        self.status = status
        self.headers = headers
        self._reader = reader

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (one item per HTTP chunk when chunked)."""
        reader = self._reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
                yield await reader.readexactly(size)
                await reader.readexactly(2)  # the CRLF after each chunk
        elif "content-length" in self.headers:
            yield await reader.readexactly(int(self.headers["content-length"]))
        else:
            yield await reader.read()

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])

    async def json(self) -> Any:
        return json.loads(await self.read())


def _head(
    url: Any, method: str, path: str, payload: bytes, headers: dict[str, str] | None
) -> bytes:
    lines = [f"{method} {url.path.rstrip('/')}{path} HTTP/1.1", f"Host: {url.netloc}"]
    lines += ["Connection: close", "Accept: */*", f"Content-Length: {len(payload)}"]
    lines += ["Content-Type: application/json"] if payload else []
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _split_url(base_url: str) -> Any:
    url = urlsplit(base_url)
    if url.scheme != "http" or not url.hostname:
        raise ValueError(f"only http://host[:port] URLs are supported, got {base_url!r}.")
    return url


@asynccontextmanager
async def request(
    base_url: str,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> AsyncIterator[Response]:
    """Send one request on a new connection; the response's body is read inside the block.

    Raises:
        ValueError: the URL is not plain http.
        OSError, asyncio.IncompleteReadError: the connection failed or broke.
    """
    url = _split_url(base_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port or 80, limit=2**22)
    try:
        payload = b"" if body is None else json.dumps(body).encode()
        writer.write(_head(url, method, path, payload, headers) + payload)
        status = int((await reader.readline()).split()[1])
        fields = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            fields[name.strip().lower()] = value.strip()
        yield Response(status, fields, reader)
    finally:
        writer.close()


class _EventProtocol(asyncio.Protocol):
    """Decodes one chunked SSE response as bytes arrive (or keeps a non-chunked body)."""

    def __init__(self, on_event: Callable[[bytes], None], done: asyncio.Future) -> None:
        self.on_event = on_event
        self.done = done
        self.buf = bytearray()
        self.status = 0
        self.chunked: bool | None = None  # None until the headers are in
        self.events = bytearray()  # de-chunked body not yet split into events

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.chunked is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1").lower()
            self.status = int(head.split(None, 2)[1])
            self.chunked = "transfer-encoding: chunked" in head
            del self.buf[: end + 4]
        if not self.chunked:
            return  # kept whole until the connection closes
        buf = self.buf
        while (eol := buf.find(b"\r\n")) >= 0:
            size = int(bytes(buf[:eol]).split(b";")[0] or b"0", 16)
            if len(buf) < eol + 2 + size + 2:
                break
            self.events += buf[eol + 2 : eol + 2 + size]
            del buf[: eol + 2 + size + 2]
        while (sep := self.events.find(b"\n\n")) >= 0:
            event = bytes(self.events[:sep])
            del self.events[: sep + 2]
            if event.startswith(b"data: "):
                self.on_event(event[6:])

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            if exc is not None or not self.status:
                self.done.set_exception(exc or ConnectionError("no response"))
            else:
                self.done.set_result(None)


async def stream_events(
    base_url: str,
    path: str,
    body: Any,
    on_event: Callable[[bytes], None],
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """POST `body` and feed each server-sent event's payload to `on_event` as it arrives.

    Returns:
        the status, and the body if the response was not an event stream (an error).
    """
    url = _split_url(base_url)
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    transport, proto = await loop.create_connection(
        lambda: _EventProtocol(on_event, done), url.hostname, url.port or 80
    )
    try:
        payload = json.dumps(body).encode()
        transport.write(_head(url, "POST", path, payload, headers) + payload)
        await done
    finally:
        transport.close()
    return proto.status, b"" if proto.chunked else bytes(proto.buf)

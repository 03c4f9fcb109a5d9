"""A cap on a request's head (request line + headers): beyond it, 431 with the error body.

uvicorn's httptools protocol buffers a head of any size until it ends (a 5 MB header is
accepted), so the cap sits in the protocol, counting bytes as they arrive, before the parser
holds them:

    connection / previous message complete ──► head: count bytes up to the blank line
        more than max_header_bytes ──► 431, stop parsing; what the client still sends is
                                       read and dropped for a moment, then the socket closes
                                       (closing at once could reset it before the client
                                       reads the answer)
    blank line seen ──► the body is not counted (BodySizeLimit caps it)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from conveyor.server.errors import error_body

_END_OF_HEAD = b"\r\n\r\n"
_DRAIN_S = 1.0  # how long a refused connection's further bytes are read and dropped


def header_limited_protocol(max_header_bytes: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the cap above (pass it as uvicorn.Config(http=...))."""
    return type(
        "HeaderLimitedProtocol", (_HeaderLimitedProtocol,), {"max_header_bytes": max_header_bytes}
    )


class _HeaderLimitedProtocol(HttpToolsProtocol):
    max_header_bytes = 64 * 1024

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._in_head, self._head_bytes, self._tail = True, 0, b""
        self._refused = False

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes, self._tail = True, 0, b""  # the next message's head
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # dropped until the socket closes
        if self._in_head:
            window = self._tail + data
            end = window.find(_END_OF_HEAD)
            self._head_bytes += len(data) if end < 0 else end + 4 - len(self._tail)
            if self._head_bytes > self.max_header_bytes:
                self._refuse()
                return
            self._tail = window[-3:]
        super().data_received(data)

    def _refuse(self) -> None:
        self._refused = True
        message = (
            f"The request line and headers are larger than this server's limit of "
            f"{self.max_header_bytes} bytes."
        )
        self.logger.warning(message)
        body = json.dumps(error_body(message, 431)).encode()
        head = (
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head + body)
        asyncio.get_running_loop().call_later(_DRAIN_S, self.transport.close)

"""Admission limits: what the server refuses at once instead of queueing without bound.

    request body larger than max_request_body_bytes  -> 413 (BodySizeLimit, before any parsing)
    n above max_n                                     -> 400, param "n"      (ServingContext)
    more than max_waiting_requests sequences waiting  -> 503 + Retry-After  (AsyncLLM)
    request_timeout                                   -> the request's deadline, at most this
All of them answer with the OpenAI error body; nothing of a refused request is queued.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from conveyor.server.errors import error_body


class BodySizeLimit:
    """Pure ASGI middleware: a body over `max_bytes` is a 413 with the OpenAI error body.

    A declared Content-Length over the limit is refused before anything is read; a body sent
    without one (chunked) is counted as the app reads it, and the read that crosses the limit
    raises, which the error handlers turn into the same 413.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"The request body is larger than this server's limit of {self.max_bytes} bytes."

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = JSONResponse(error_body(self._message(), 413), status_code=413)
            await response(scope, receive, send)
            return
        seen = 0

        async def counted_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted_receive, send)

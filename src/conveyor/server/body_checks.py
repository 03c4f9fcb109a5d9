"""What a request body may be before FastAPI's pydantic model reads it: every route's body
goes through BodyCheckedRoute.

    body bytes ──► deep_text_path ──► nested deeper than MAX_JSON_DEPTH: 400, param = the
                        │                top-level field holding it
                        ▼
                   json.loads ──► more `messages` than max_chat_messages: 400
                        │
                        ▼
                   FastAPI's pydantic model

The depth is checked on the raw bytes, before json.loads, pydantic, a schema's compile or the
pickle that takes it to the engine process: each of those recurses once per level, and a
schema nested a few hundred levels deep once killed the engine pipe's writer thread
(conveyor/json_depth.py measures without recursion). A body over OFFLOAD_BYTES is checked and
parsed in the heavy text lane (server/offload.py), so the event loop serves other requests
meanwhile; the message count is read from the parsed JSON, before pydantic builds one object
per message (the dearest part of a body of 65,000 empty messages).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from conveyor.json_depth import MAX_JSON_DEPTH, deep_text_path, format_path
from conveyor.server.offload import off_loop

# Bodies larger than this are parsed off the event loop (smaller ones take under a ms).
OFFLOAD_BYTES = 64 << 10


class BodyRefusedError(HTTPException):
    """A 400 that names the field (FastAPI re-raises HTTPExceptions from body parsing)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(400, message)
        self.param = param


def parse_body(body: bytes) -> Any:
    """json.loads(body), once its depth is checked (BodyRefusedError: too deep)."""
    path = deep_text_path(body, MAX_JSON_DEPTH)
    if path is not None:
        raise BodyRefusedError(
            f"The request body must nest at most {MAX_JSON_DEPTH} objects and arrays "
            f"deep; {format_path(path) or 'it'} goes deeper.",
            param=path[0] if path and isinstance(path[0], str) else None,
        )
    return json.loads(body)


class _CheckedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            parsed = (
                await off_loop(parse_body, body)
                if len(body) > OFFLOAD_BYTES
                else (parse_body(body))
            )
            cap = getattr(self.app.state, "max_chat_messages", None)
            messages = parsed.get("messages") if isinstance(parsed, dict) else None
            if cap is not None and isinstance(messages, list) and len(messages) > cap:
                raise BodyRefusedError(
                    f"messages holds {len(messages)} messages, more than this server takes in "
                    f"one request (max_chat_messages: {cap}).",
                    param="messages",
                )
            self._json = parsed
        return self._json


class BodyCheckedRoute(APIRoute):
    """An APIRoute whose JSON body is checked (and, when large, parsed off the event loop)
    before pydantic reads it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(_CheckedRequest(request.scope, request.receive))

        return checked

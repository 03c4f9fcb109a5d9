"""Request bodies nest at most MAX_JSON_DEPTH objects and arrays deep, or they are a 400.

Checked on the raw bytes, before json.loads, pydantic, a schema's compile or the pickle that
takes it to the engine process: each of those recurses once per level, and a schema nested a
few hundred levels deep once killed the engine pipe's writer thread (conveyor/json_depth.py
measures without recursion). Every route's body goes through DepthCheckedRoute:

    body bytes ──► deep_text_path ──► too deep: 400, param = the top-level field holding it
                        │ fine
                        ▼
                   json.loads ──► FastAPI's pydantic model
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from conveyor.json_depth import MAX_JSON_DEPTH, deep_text_path, format_path


class BodyTooDeepError(HTTPException):
    """A 400 that names the field (FastAPI re-raises HTTPExceptions from body parsing)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(400, message)
        self.param = param


class _DepthCheckedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            path = deep_text_path(body, MAX_JSON_DEPTH)
            if path is not None:
                raise BodyTooDeepError(
                    f"The request body must nest at most {MAX_JSON_DEPTH} objects and arrays "
                    f"deep; {format_path(path) or 'it'} goes deeper.",
                    param=path[0] if path and isinstance(path[0], str) else None,
                )
            self._json = json.loads(body)
        return self._json


class DepthCheckedRoute(APIRoute):
    """An APIRoute whose JSON body is depth-checked before it is parsed."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(_DepthCheckedRequest(request.scope, request.receive))

        return checked

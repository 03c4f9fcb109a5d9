"""Every error the server sends, in one place: `{"error": {"message", "type", "param", "code"}}`.

    pydantic RequestValidationError (422), malformed JSON  -> 400 BadRequestError, param = field
    a body nested too deep, too many messages (body_checks.py) -> 400, param = field
    APIError / ValueError (SamplingParams, engine checks)  -> 400 (or the APIError's status)
    RequestRejectedError (the engine refused it, e.g. a grammar too slow to compile) -> 400
    unknown route / method (the message names them)         -> 404 / 405 (with Allow)
    body over max_request_body_bytes (server/admission.py)  -> 413
    headers over max_header_bytes (server/http_limits.py)   -> 431
    EngineNotRunningError (dead engine, shutting down)      -> 503 ServiceUnavailableError
    EngineOverloadedError (waiting queue full)              -> 503 with a Retry-After header
    RequestFailedError, anything else                       -> 500, logged; never a traceback
As in vLLM, `type` names the HTTP error (the openai SDK raises the matching exception) and
`code` is the status.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from conveyor.entrypoints.async_llm import (
    EngineNotRunningError,
    EngineOverloadedError,
    RequestFailedError,
    RequestRejectedError,
)

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(ValueError):
    """A request the server refuses, with the HTTP status and the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object for `status`. Text that UTF-8 cannot encode (a lone surrogate
    echoed from a request) is escaped, so the error itself always reaches the client."""
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    message, param = _encodable(message), None if param is None else _encodable(param)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def sse_error(exc: BaseException) -> str:
    """The SSE event that reports an error after a stream has started."""
    status, message, param = classify(exc)
    return f"data: {json.dumps(error_body(message, status, param))}\n\n"


def classify(exc: BaseException, log: bool = True) -> tuple[int, str, str | None]:
    """Map an exception to (status, message, param); unexpected ones are logged if `log`."""
    if isinstance(exc, APIError):
        return exc.status, exc.message, exc.param
    if isinstance(exc, RequestRejectedError):
        return 400, str(exc), exc.param
    if isinstance(exc, ValueError):
        return 400, str(exc), None
    if isinstance(exc, (EngineNotRunningError, EngineOverloadedError)):
        return 503, str(exc), None
    if isinstance(exc, RequestFailedError):
        return 500, str(exc), None
    if log:
        logger.error("Unexpected error while serving a request", exc_info=exc)
    return 500, f"Internal server error ({type(exc).__name__}); see the server log.", None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        return f"Malformed JSON in the request body: {detail.get('ctx', {}).get('error')}.", None
    parts: list[str] = []
    param = None
    for e in errors[:5]:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc) or "body"
        msg = e.get("msg")
        if e.get("type") == "extra_forbidden":  # OpenAI's wording for a field it does not know
            msg = "unrecognized request argument (this server does not know or honour it)"
        part = f"{where}: {msg}"
        if part not in parts:
            parts.append(part)
    return "; ".join(parts) or "Invalid request.", param


def install_error_handlers(app: FastAPI) -> None:
    """Route every error of `app` through the one body format above."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        status, message = exc.status_code, str(exc.detail)
        path = request.url.path
        where = f"{request.method} {path if len(path) <= 200 else path[:200] + '...'}"
        # The router's own: no route has this path, or none takes this method on it.
        if status == 404 and message == "Not Found":
            message = f"Invalid URL ({where}): this server has no such route."
        elif status == 405 and message == "Method Not Allowed":
            allow = (exc.headers or {}).get("Allow")
            methods = f" (it takes {allow})" if allow else ""
            message = f"Method not allowed ({where}): the route exists{methods}."
        response = error_response(message, status, getattr(exc, "param", None))
        response.headers.update(exc.headers or {})
        return response

    async def _known(_: Request, exc: Exception) -> JSONResponse:
        status, message, param = classify(exc)
        response = error_response(message, status, param)
        if isinstance(exc, EngineOverloadedError):
            response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    for known in (ValueError, EngineNotRunningError, EngineOverloadedError, RequestFailedError):
        app.add_exception_handler(known, _known)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this response is sent; the client gets none.
        status, message, param = classify(exc, log=False)
        return error_response(message, status, param)

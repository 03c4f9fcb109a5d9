"""Admission limits: what the server refuses at once instead of queueing without bound.

    request body larger than max_request_body_bytes  -> 413 (BodySizeLimit, before any parsing)
    n above max_n                                     -> 400, param "n"      (ServingContext)
    more than max_waiting_requests sequences waiting  -> 503 + Retry-After  (AsyncLLM)
    a client over max_client_sequences / max_client_tokens in flight
                                                      -> 429 + Retry-After  (ClientLimits)
    request_timeout                                   -> the request's deadline, at most this
All of them answer with the OpenAI error body; nothing of a refused request is queued.

Per-client limits: a client is its tenant header when `cache_salt_from header:NAME` names one
and the server has no API keys, else server/clients.py's: its API key, else its address. What
it has in flight is the sum over its open HTTP requests of each engine request's n sequences
and n x (prompt + max_tokens) tokens (an embedding input: 1 and its length + 1), charged as
each is queued (AsyncLLM's `before_add` hook) and released when its HTTP request ends. A
request that would take its client over a limit gets 429 with Retry-After (400 when it alone
is over it, since retrying cannot help); whatever it had already queued (the earlier prompts
of a batch) is aborted, as is anything of an HTTP request that ends with work still open.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from conveyor.server.clients import current_client
from conveyor.server.errors import APIError, error_body

if TYPE_CHECKING:
    from conveyor.entrypoints.async_llm import AsyncLLM
    from conveyor.sampling_params import SamplingParams
    from conveyor.server.config import ServerConfig

_RETRY_AFTER_S = 1


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


class ClientLimitError(APIError):
    """A client would hold more than the server's per-client limits (429, Retry-After)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param, status=429)


class _Charge:
    """What one HTTP request has queued: its client, sequences, tokens and engine request
    ids (so that those still open when it ends are aborted)."""

    __slots__ = ("client", "refused", "request_ids", "seqs", "tokens")

    def __init__(self, client: str) -> None:
        self.client = client
        self.seqs = self.tokens = 0
        self.request_ids: list[str] = []
        self.refused = False


_CURRENT: contextvars.ContextVar[_Charge | None] = contextvars.ContextVar(
    "conveyor_client_charge", default=None
)


class ClientLimits:
    """Each client's sequences and tokens in flight, against `max_sequences` and
    `max_tokens` (None: no limit). See the module docstring."""

    def __init__(
        self,
        max_sequences: int | None,
        max_tokens: int | None,
        max_model_len: int,
    ) -> None:
        self.max_sequences = max_sequences
        self.max_tokens = max_tokens
        self._max_model_len = max_model_len
        self.in_flight: dict[str, list[int]] = {}  # client -> [sequences, tokens]

    @property
    def enabled(self) -> bool:
        return self.max_sequences is not None or self.max_tokens is not None

    def charge(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """AsyncLLM's `before_add`: count one engine request against its HTTP request's
        client (no-op outside an HTTP request).

        Raises:
            ClientLimitError: the client would go over a limit (429).
            APIError: this HTTP request alone is over a limit (400).
        """
        charge = _CURRENT.get()
        if charge is None:
            return
        n = params.n
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self._max_model_len - len(prompt_ids))
        seqs, tokens = n, n * (len(prompt_ids) + max_tokens)
        held = self.in_flight.get(charge.client, [0, 0])
        for name, limit, mine, total, new in (
            ("sequences", self.max_sequences, charge.seqs, held[0], seqs),
            ("tokens", self.max_tokens, charge.tokens, held[1], tokens),
        ):
            if limit is None or total + new <= limit:
                continue
            charge.refused = True
            what = "n x (prompt + max_tokens) tokens" if name == "tokens" else "sequences (n each)"
            if mine + new > limit:
                raise APIError(
                    f"This request asks for {mine + new} {what} or more, more than one client "
                    f"may have in flight on this server ({limit}); send fewer or smaller "
                    "prompts, a smaller n or a smaller max_tokens.",
                    param="n" if n > 1 else None,
                )
            raise ClientLimitError(
                f"Too many {name} in flight for this client: {total} held, this request adds "
                f"{new}, at most {limit} ({what}). Retry when earlier requests have finished."
            )
        charge.seqs += seqs
        charge.tokens += tokens
        charge.request_ids.append(request_id)
        held = self.in_flight.setdefault(charge.client, [0, 0])
        held[0] += seqs
        held[1] += tokens

    def release(self, charge: _Charge) -> None:
        held = self.in_flight.get(charge.client)
        if held is None:
            return
        held[0] -= charge.seqs
        held[1] -= charge.tokens
        if held[0] <= 0 and held[1] <= 0:
            del self.in_flight[charge.client]


class ClientLimitMiddleware:
    """Pure ASGI: each HTTP request runs with its own charge (a context variable that
    `ClientLimits.charge` reads); when it ends the charge is released and any engine request
    of it still open is aborted. A 429 it caused gets the Retry-After header."""

    def __init__(self, app: Any, limits: ClientLimits, engine: AsyncLLM) -> None:
        self.app = app
        self.limits = limits
        self.engine = engine

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        charge = _Charge(current_client())
        token = _CURRENT.set(charge)

        async def send_with_retry_after(message: dict[str, Any]) -> None:
            if (
                message["type"] == "http.response.start"
                and message.get("status") == 429
                and charge.refused
            ):
                headers = [*message.get("headers", []), (b"retry-after", b"%d" % _RETRY_AFTER_S)]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_retry_after)
        finally:
            _CURRENT.reset(token)
            self.limits.release(charge)
            if charge.request_ids:
                self.engine.abort_open(charge.request_ids)


def install_client_limits(app: Any, engine: AsyncLLM, config: ServerConfig) -> ClientLimits | None:
    """Count each client's work in flight against config's max_client_sequences and
    max_client_tokens (neither set: nothing to do). Call before ClientIdentity is added (it
    says whose request it is)."""
    limits = ClientLimits(
        config.max_client_sequences, config.max_client_tokens, engine.max_model_len
    )
    if not limits.enabled:
        return None
    engine.before_add = limits.charge
    app.add_middleware(ClientLimitMiddleware, limits=limits, engine=engine)
    return limits

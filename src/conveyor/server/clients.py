"""Who a request comes from, for limits that are per client and the scheduler's tenants (its
tenant header where `--cache-salt-from header:NAME` names one and there are no API keys, else
its API key, else its address), and when it came (its deadline and latency count from then,
not from when the engine got it).

`ClientIdentity` (ASGI middleware) sets `current_client()` and `request_arrival()` for the
request's whole handling, so code deep in a request's path (server/constraints.py's grammar
checks, the engine calls) reads them without every signature on the way carrying them. A key
is hashed, never kept; two keys are two clients even from one address, and without keys
every address is a client.
"""

from __future__ import annotations

import hashlib
import time
from contextvars import ContextVar
from typing import Any

from conveyor.server.tenancy import bearer_credentials

_CLIENT: ContextVar[str] = ContextVar("conveyor_client", default="")
_ARRIVAL: ContextVar[float | None] = ContextVar("conveyor_arrival", default=None)


def current_client() -> str:
    """The client of the request being handled ("" outside one)."""
    return _CLIENT.get()


def request_arrival() -> float | None:
    """When the request being handled reached the app (time.monotonic; None outside one)."""
    return _ARRIVAL.get()


def client_of(scope: dict[str, Any], tenant_header: bytes | None = None) -> str:
    """ "tenant:<hash>" of the `tenant_header` values when one is given, else "key:<hash>"
    for a request with a bearer key, else "addr:<host>"."""
    if tenant_header is not None:
        values = [v for k, v in scope.get("headers") or () if k == tenant_header]
        return "tenant:" + hashlib.sha256(b"\x00".join(values)).hexdigest()[:32]
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            key = bearer_credentials(value)
            if key:
                return "key:" + hashlib.sha256(b"conveyor-client\x00" + key).hexdigest()[:32]
    peer = scope.get("client")
    return f"addr:{peer[0]}" if peer else "addr:"


class ClientIdentity:
    """ASGI middleware: `current_client()` and `request_arrival()` are the request's while it
    is handled."""

    def __init__(self, app: Any, tenant_header: bytes | None = None) -> None:
        self.app = app
        self.tenant_header = tenant_header

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = _CLIENT.set(client_of(scope, self.tenant_header))
        arrival = _ARRIVAL.set(time.monotonic())
        try:
            await self.app(scope, receive, send)
        finally:
            _ARRIVAL.reset(arrival)
            _CLIENT.reset(token)

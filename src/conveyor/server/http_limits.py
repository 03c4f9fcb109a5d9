"""What a connection may cost before its request reaches the app: the size and time of a
request's head, the pace of its body, and the connection caps (server/connections.py).

uvicorn's httptools protocol buffers a head of any size (a 5 MB header is accepted) and waits
for a head or a body forever: its one timer is keep-alive's, armed after a response. So the
protocol here counts and times what arrives, before the parser holds it:

    accepted ──► over a connection cap with nothing idle to close ──► 503
    connected, or the next request's first byte after a keep-alive pause
        head: bytes up to the blank line
            more than max_header_bytes ──► 431
            incomplete after header_timeout s ──► 408 (nothing sent at all: just closed)
    head complete ──► body: it must keep coming, else 408: no byte for body_timeout s, or
        less than body_min_rate bytes a second on average after the first body_timeout s
        (the clock stops while the client waits for our 100 Continue or the app has paused
        reading)
    body complete ──► the response: no timer (a long stream is the server's doing)
    response done ──► kept alive keep_alive_timeout s for the next request (uvicorn's timer)

A refused or timed-out connection gets its error body with `connection: close`; what the
client still sends is read and dropped for a moment, then the socket closes (closing at once
could reset it before the client reads the answer). At shutdown a connection still sending its
request (or connected but not yet sending it) is answered 503 and closed, so a slow client
cannot hold the process open and a request that was on its way is told, not reset.
"""

from __future__ import annotations

import json
from asyncio import TimerHandle, Transport
from dataclasses import dataclass
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from conveyor.server.connections import ConnectionTable
from conveyor.server.errors import error_body

_END_OF_HEAD = b"\r\n\r\n"
_DRAIN_S = 1.0  # how long a refused connection's further bytes are read and dropped
_HEAD, _BODY, _RESPONSE, _KEEP_ALIVE = "head", "body", "response", "keep-alive"  # waiting for


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """ServerConfig's settings of the same names (bytes, seconds, bytes a second)."""

    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    body_min_rate: float


def limited_protocol(limits: ConnectionLimits, table: ConnectionTable) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the limits above (uvicorn.Config(http=...)); every
    connection it serves is counted in `table`."""
    return type("LimitedProtocol", (_LimitedProtocol,), {"limits": limits, "table": table})


class _LimitedProtocol(HttpToolsProtocol):
    limits: ConnectionLimits
    table: ConnectionTable

    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head, self._head_bytes, self._tail = True, 0, b""
        self._closing = self._lingering = False
        self._timer: TimerHandle | None = None
        self._body_start = self._body_last = 0.0
        self._body_bytes = 0
        self._phase = _HEAD
        if not self.table.admit(self, self.client[0] if self.client else ""):
            message = "The server has too many connections open (from this client or in all)."
            self._close_with(503, message + " Retry later.")
            return
        self._wait_for_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.table.release(self)
        if self._lingering:
            self._lingering = False
            self.table.lingering -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return  # dropped until the socket closes
        if self._in_head:
            window = self._tail + data
            end = window.find(_END_OF_HEAD)
            self._head_bytes += len(data) if end < 0 else end + 4 - len(self._tail)
            if self._head_bytes > self.limits.max_header_bytes:
                self.table.note("refused (headers too large)")
                self._close_with(
                    431,
                    f"The request line and headers are larger than this server's limit of "
                    f"{self.limits.max_header_bytes} bytes.",
                )
                return
            self._tail = window[-3:]
        super().data_received(data)

    # Parser callbacks: where the connection stands.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._phase == _KEEP_ALIVE:
            self.table.mark_busy(self)  # idle again, but now the newest: evicted last
            self.table.mark_idle(self)
        if self._phase != _HEAD:
            self._wait_for_head()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()
        self.table.mark_busy(self)
        self._phase = _BODY
        self._body_start = self._body_last = self.loop.time()
        self._body_bytes = 0
        self._arm(self.loop.call_later(self.limits.body_timeout, self._check_body))

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._body_bytes += len(body)
        self._body_last = self.loop.time()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes, self._tail = True, 0, b""  # the next message's head
        super().on_message_complete()
        self._cancel_timer()
        self._phase = _RESPONSE
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and not self.transport.is_closing():
            # Answered before the body ended (401, 413): the body's bytes cancelled uvicorn's
            # keep-alive timer, which it arms only as a response completes. Arm it again.
            self._keep_alive()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None and self._phase == _RESPONSE:
            self._phase = _KEEP_ALIVE  # nothing pipelined: idle until the next request
            self.table.mark_idle(self)

    def shutdown(self) -> None:
        # A request on its way (its head or body partly in, or a new connection's not read
        # yet) will never be served: 503, where a plain close resets it once its bytes come.
        # An idle keep-alive connection is only closed.
        arriving = self._phase == _HEAD and (self.cycle is None or self._head_bytes > 0)
        if (self._phase == _BODY or arriving) and not self._closing:
            self._close_with(503, "The server is shutting down.")
        else:
            super().shutdown()

    def evict(self) -> None:
        """Close this idle connection to make room (ConnectionTable's choice)."""
        if self._phase == _HEAD and self._head_bytes:
            self._close_with(503, "The server closed this connection to make room for others.")
        else:
            self._cancel_timer()
            self._closing = True
            self.transport.close()

    # Timers.
    def _wait_for_head(self) -> None:
        self._phase = _HEAD
        self._arm(self.loop.call_later(self.limits.header_timeout, self._head_late))

    def _head_late(self) -> None:
        self._timer = None
        self.table.note("timed out (headers)")
        if not self._head_bytes and self._phase == _HEAD and self.cycle is None:
            self.evict()  # nothing sent: closed as an idle keep-alive connection is
            return
        seconds = self.limits.header_timeout
        self._close_with(408, f"The request line and headers did not arrive within {seconds:g} s.")

    def _check_body(self) -> None:
        self._timer = None
        now = self.loop.time()
        cycle = self.cycle
        if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
            # We are not reading, or the client waits for our 100 Continue: not its delay.
            self._body_start = self._body_last = now
            self._body_bytes = 0
        timeout, rate = self.limits.body_timeout, self.limits.body_min_rate
        due = min(self._body_start + timeout + self._body_bytes / rate, self._body_last + timeout)
        if now < due:
            self._arm(self.loop.call_at(due, self._check_body))
            return
        self.table.note("timed out (body)")
        self._close_with(
            408,
            f"The request body stopped arriving: this server needs a byte at least every "
            f"{timeout:g} s and {rate:g} bytes a second on average.",
        )

    def _keep_alive(self) -> None:
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
        self._phase = _KEEP_ALIVE
        self.table.mark_idle(self)

    def _arm(self, timer: TimerHandle) -> None:
        self._cancel_timer()
        self._timer = timer

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _close_with(self, status: int, message: str) -> None:
        """Answer `status` with the error body (unless a response has started) and close,
        reading and dropping what the client still sends for a moment first."""
        if self._closing:
            return
        self._closing = True
        self._cancel_timer()
        self.table.release(self)
        cycle = self.cycle  # in the head phase: the previous request's, if any
        previous_done = self._phase == _HEAD and cycle is not None and cycle.response_complete
        if cycle is None or not cycle.response_started or previous_done:
            self.transport.write(_error_response(status, message))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() says http.disconnect; sends dropped
            cycle.message_event.set()
        if self.table.lingering >= self.table.max_lingering:
            self.transport.close()  # too many draining already: a reset is possible, a leak not
            return
        self._lingering = True
        self.table.lingering += 1
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_DRAIN_S, self.transport.close)


def _error_response(status: int, message: str) -> bytes:
    body = json.dumps(error_body(message, status)).encode()
    retry = b"retry-after: 1\r\n" if status == 503 else b""
    return (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()
        + b"content-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\nconnection: close\r\n"
        + retry
        + b"\r\n"
        + body
    )

"""How many connections the server holds, in all and per client, and which one goes first.

Every connection holds a file descriptor, and the process has RLIMIT_NOFILE of them. Without a
cap, idle connections fill the limit; accept() then fails with EMFILE and asyncio stops
accepting for a second at a time, so new clients hang while the idle ones stay. So:

    start-up   the soft RLIMIT_NOFILE is raised to the hard one; the connection cap is what is
               left of it after the descriptors in use and a reserve (1/16 of the limit, at
               least 64) for the engine's pipes and files and for refusing clients cleanly
    accept     a client under its own cap and the server under the total ──► admitted
               over a cap ──► the cap's oldest idle connection (no request of it in progress:
                   waiting for its first request's head, or kept alive between requests) is
                   closed to make room; with none idle ──► 503 and closed
    a refused connection keeps its descriptor for up to a second (so the client reads the 503
    rather than a reset); at most half the reserve do at once, the rest are reset at once.

The per-client default is half the total (at least 1,024, or the total if smaller): one
address can never take every connection, yet a gateway or a load generator on one address
still has room for hundreds of streams.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import OrderedDict
from typing import Protocol

logger = logging.getLogger("conveyor.server")

MAX_DEFAULT_CONNECTIONS = 65536  # ~6 KB of server memory each when idle: ~400 MB at most
MIN_PER_CLIENT_DEFAULT = 1024
LOG_EVERY_S = 10.0  # refusals and time-outs are summed up in one warning this often at most


class Evictable(Protocol):
    def evict(self) -> None:
        """Close this idle connection now to make room for a new one."""


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as nginx and others do); the limit."""
    try:
        import resource
    except ImportError:  # not POSIX: nothing to raise
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            logger.warning("Cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft if soft != resource.RLIM_INFINITY else 2**20


def descriptors_in_use() -> int:
    """File descriptors this process has open now (a guess where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


def connection_caps(
    max_connections: int | None, max_per_client: int | None, limit: int, in_use: int
) -> tuple[int, int, int]:
    """(total cap, per-client cap, most refusals lingering at once) for an open-file `limit`
    of which `in_use` descriptors are taken; None: the module docstring's defaults. A total
    beyond what the limit leaves is lowered to it, with a warning."""
    reserve = max(64, limit // 16)
    room = max(1, limit - in_use - reserve)
    if max_connections is None:
        total = min(room, MAX_DEFAULT_CONNECTIONS)
    else:
        total = min(max_connections, room)
        if total < max_connections:
            logger.warning(
                "max_connections %d does not fit the open-file limit %d (%d in use, %d kept "
                "in reserve): serving at most %d connections; raise the limit (ulimit -n) for "
                "more.",
                max_connections, limit, in_use, reserve, total,
            )  # fmt: skip
    if max_per_client is None:
        per_client = min(total, max(total // 2, MIN_PER_CLIENT_DEFAULT))
    else:
        per_client = min(max_per_client, total)
    return total, per_client, reserve // 2


class ConnectionTable:
    """The admitted connections, counted in all and per client address, with the idle ones
    in the order they became idle (the oldest is evicted first)."""

    def __init__(self, max_connections: int, max_per_client: int, max_lingering: int) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.max_lingering = max_lingering
        self._client_of: dict[Evictable, str] = {}
        self._per_client: dict[str, int] = {}
        self._idle: OrderedDict[Evictable, None] = OrderedDict()
        self._idle_of: dict[str, OrderedDict[Evictable, None]] = {}
        self.lingering = 0  # refused connections still holding their descriptor
        self._events: dict[str, int] = {}
        self._logged = -math.inf
        self._flush_pending = False

    def count(self, client: str) -> int:
        return self._per_client.get(client, 0)

    def admit(self, conn: Evictable, client: str) -> bool:
        """Count `conn` in, idle, evicting an idle connection over a cap; False: refuse it."""
        if self.count(client) >= self.max_per_client and not self._evict(self._idle_of.get(client)):
            self.note("refused (client cap)")
            return False
        if len(self._client_of) >= self.max_connections and not self._evict(self._idle):
            self.note("refused (server cap)")
            return False
        self._client_of[conn] = client
        self._per_client[client] = self.count(client) + 1
        self.mark_idle(conn)
        return True

    def mark_idle(self, conn: Evictable) -> None:
        """No request of `conn` is in progress: it may be evicted, after older idle ones."""
        client = self._client_of.get(conn)
        if client is not None and conn not in self._idle:
            self._idle[conn] = None
            self._idle_of.setdefault(client, OrderedDict())[conn] = None

    def mark_busy(self, conn: Evictable) -> None:
        """A request of `conn` is in progress: never evicted until it is idle again."""
        if conn in self._idle:
            del self._idle[conn]
            client = self._client_of[conn]
            of_client = self._idle_of[client]
            del of_client[conn]
            if not of_client:
                del self._idle_of[client]

    def release(self, conn: Evictable) -> None:
        """`conn` is closed or closing (idempotent)."""
        self.mark_busy(conn)
        client = self._client_of.pop(conn, None)
        if client is not None:
            left = self._per_client[client] - 1
            if left:
                self._per_client[client] = left
            else:
                del self._per_client[client]

    def _evict(self, idle: OrderedDict[Evictable, None] | None) -> bool:
        if not idle:
            return False
        victim = next(iter(idle))
        self.release(victim)
        victim.evict()
        self.note("idle closed to make room")
        return True

    def note(self, event: str) -> None:
        """Count a refused, evicted or timed-out connection. One warning sums them up at most
        every LOG_EVERY_S seconds (the last ones once that time is up), so that a flood of
        them does not flood the log too. Called on the event loop."""
        self._events[event] = self._events.get(event, 0) + 1
        if self._flush_pending:
            return
        wait = self._logged + LOG_EVERY_S - time.monotonic()
        if wait <= 0:
            self._flush()
        else:
            self._flush_pending = True
            asyncio.get_running_loop().call_later(wait, self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        summary = ", ".join(f"{n} {event}" for event, n in sorted(self._events.items()))
        logger.warning(
            "Connections: %s (now %d open; caps: %d in all, %d per client).",
            summary, len(self._client_of), self.max_connections, self.max_per_client,
        )  # fmt: skip
        self._events.clear()
        self._logged = time.monotonic()

"""run_server: build the engine and the app, serve with uvicorn, shut down gracefully.

On SIGTERM or Ctrl-C:
    t = 0      stop admitting: new requests get 503, /health 503 (the socket stays open)
    0..grace   in-flight requests run on and finish normally
    t = grace  the rest are aborted: their streams end with finish_reason "abort" and [DONE]
    then       (or as soon as nothing is in flight) uvicorn closes the socket (a connection
               still sending its request, or with none read yet, gets 503:
               server/http_limits.py), the engine loop stops and the process exits with
               status 0. A request not yet queued (its output constraint or chat template
               still in hand) gets 503 too, at the latest at uvicorn's backstop, the grace
               period + 5 s (server/app.py)
A second signal exits at once (uvicorn's force exit).

If the engine dies (its process is killed or crashes), its in-flight requests end with an
error event, new ones get 503, and the server then stops by itself and exits with status 1
(ENGINE_DIED_EXIT_CODE), so a supervisor (docker's restart policy, Kubernetes, systemd)
restarts it. A single engine is not restarted in place: a fresh process is the one state known
good. With --data-parallel-size N, a replica that dies fails only its own requests and is
restarted in a fresh process (at most --max-replica-restarts times each); /health says how
many replicas serve; a death past the limit exits with status 1 as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import math
import socket
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from conveyor.config import EngineConfig
from conveyor.heap import release_freed_memory
from conveyor.server.config import ServerConfig
from conveyor.server.connections import (
    ConnectionTable,
    connection_caps,
    descriptors_in_use,
    raise_open_file_limit,
)

if TYPE_CHECKING:  # imported in run_server, once the port is ours: they import torch
    from conveyor.entrypoints.async_llm import AsyncLLM

logger = logging.getLogger("conveyor.server")

ENGINE_DIED_EXIT_CODE = 1


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until SIGTERM / Ctrl-C.

    Args:
        engine_config: the engine's settings (model None: the demo model).
        server_config: host, port, key, served name, shutdown grace period, logging.
    Returns:
        0 once the server has stopped after a signal; ENGINE_DIED_EXIT_CODE if it stopped
        because the engine died.
    Raises:
        ValueError: the port cannot be bound (found before the model is loaded), or the
            engine rejected the config or the checkpoint.
    """
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    # Bound first: a busy port fails in milliseconds, not after the model has loaded.
    sock = bind_socket(server_config.host, server_config.port)
    open_files = raise_open_file_limit()  # before the engine starts, so it inherits the limit
    with sock:  # closed if anything below fails (uvicorn closes it as it stops, too)
        from conveyor.entrypoints.async_llm import AsyncLLM
        from conveyor.server.app import build_app
        from conveyor.server.http_limits import ConnectionLimits, limited_protocol

        engine = AsyncLLM.from_config(
            engine_config,
            served_model_name=server_config.served_model_name,
            log_stats_interval_s=server_config.log_stats_interval,
            max_waiting_requests=server_config.max_waiting_requests,
            engine_process=server_config.engine_process,
            engine_stall_timeout_s=server_config.engine_stall_timeout or None,
            engine_heartbeat_timeout_s=server_config.engine_heartbeat_timeout or None,
            max_replica_restarts=server_config.max_replica_restarts,
        )
        app = build_app(engine, config=server_config)
        grace = server_config.shutdown_timeout
        table = connection_table(server_config, open_files)
        limits = ConnectionLimits(
            max_header_bytes=server_config.max_header_bytes,
            header_timeout=server_config.header_timeout,
            body_timeout=server_config.body_timeout,
            body_min_rate=server_config.body_min_rate,
        )
        config = uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level=server_config.log_level,
            http=limited_protocol(limits, table),
            timeout_keep_alive=server_config.keep_alive_timeout,  # type: ignore[arg-type]
            # A backstop only: our own deadline aborts what is left after `grace` seconds.
            timeout_graceful_shutdown=math.ceil(grace) + 5,
        )
        logger.info(
            "Serving %s as %s on http://%s:%d (max_model_len %d, API key %s, at most %d "
            "connections, %d per client)",
            engine.model_path,
            ", ".join(repr(name) for name in engine.served_model_names),
            server_config.host,
            server_config.port,
            engine.max_model_len,
            "required" if server_config.api_key else "not required",
            table.max_connections,
            table.max_per_client,
        )
        # Everything built so far (model, tokenizer, app) lives until exit: keep the cyclic GC
        # from rescanning it on every collection, which otherwise stalls streaming (and, through
        # the GIL, an engine thread of this process) under load.
        gc.collect()
        gc.freeze()
        release_freed_memory()  # what start-up freed (the tokenizer's build) leaves the heap
        server = _GracefulServer(config, engine, grace)
        # uvicorn re-raises a captured Ctrl-C once it has shut down: that is a normal exit.
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
    return server.exit_code


def connection_table(server_config: ServerConfig, open_files: int) -> ConnectionTable:
    """The connection caps (server/connections.py) for an open-file limit of `open_files`,
    measured against the descriptors the process holds now (the model loaded)."""
    total, per_client, lingering = connection_caps(
        server_config.max_connections,
        server_config.max_connections_per_client,
        open_files,
        descriptors_in_use(),
    )
    return ConnectionTable(total, per_client, lingering)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (uvicorn listens once the app
    is up, so a client that comes early is refused rather than left hanging).

    Raises:
        ValueError: the port is in use, or the address cannot be bound (what to change).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn does: a restart may rebind while old connections sit in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(
                f"port {port} on {host} is already in use; choose another with --port."
            ) from None
        reason = exc.strerror or str(exc)
        raise ValueError(
            f"cannot listen on {host}:{port}: {reason}; check --host and --port."
        ) from None
    return sock


class _GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains the engine before it stops listening.

    The first SIGTERM / Ctrl-C leaves uvicorn running: the engine stops admitting (new
    requests and /health get 503) while in-flight requests go on. Once none is left, or the
    grace period is over and the engine aborted the rest, uvicorn shuts down as usual: it
    closes the socket, lets open responses end, runs the lifespan's shutdown. A second signal
    exits at once (uvicorn's force exit). The signal is not re-raised afterwards, as uvicorn
    would, so a drained server exits with status 0.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task[None] | None = None
        self.exit_code = 0

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        watcher = self._loop.create_task(self._exit_when_engine_dies())
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()

    async def _exit_when_engine_dies(self) -> None:
        """Stop serving once the engine is dead; the in-flight requests have been told (their
        streams end with an error event while uvicorn lets open responses finish)."""
        while not self._engine.dead:
            await asyncio.sleep(0.1)
        logger.error(
            "The engine died; stopping the server with exit status %d so that a supervisor "
            "restarts it.",
            ENGINE_DIED_EXIT_CODE,
        )
        self.exit_code = ENGINE_DIED_EXIT_CODE
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None:
            super().handle_exit(sig, frame)
            self.force_exit = self._draining
        else:
            self._draining = True
            logger.info(
                "Shutting down: no new requests; in-flight ones have %.0f s to finish.",
                self._grace,
            )
            # Signal handlers run between bytecodes of the loop's thread: hand over safely.
            self._loop.call_soon_threadsafe(self._begin_drain)
        self._captured_signals.clear()  # exit 0 instead of re-raising the signal

    def _begin_drain(self) -> None:
        self._engine.begin_shutdown(self._grace)
        loop = asyncio.get_running_loop()
        # Output-constraint checks still running when the grace period ends are killed (their
        # requests get 503), as the engine aborts what it still has: none is waited for.
        grammars = getattr(self.config.app.state, "grammars", None)
        if grammars is not None:
            loop.call_later(self._grace, grammars.close)
        self._drain_task = loop.create_task(self._drain())

    async def _drain(self) -> None:
        """Stop uvicorn once every request has ended (the engine aborts what is left after the
        grace period, so this ends by then)."""
        while self._engine.num_unfinished_requests and not self.should_exit:
            await asyncio.sleep(0.05)
        self.should_exit = True

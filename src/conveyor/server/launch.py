"""run_server: build the engine and the app, serve with uvicorn, shut down gracefully.

On SIGTERM or Ctrl-C:
    t = 0      stop admitting (listening socket closed, new requests get 503, /health 503)
    0..grace   in-flight requests run on and finish normally
    t = grace  the rest are aborted: their streams end with finish_reason "abort" and [DONE]
    then       the engine loop stops and the process exits
A second Ctrl-C exits at once (uvicorn's force exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from types import FrameType
from typing import Any

import uvicorn

from conveyor.async_engine import AsyncLLM
from conveyor.config import EngineConfig
from conveyor.server.app import build_app
from conveyor.server.config import ServerConfig

logger = logging.getLogger("conveyor.server")


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until SIGTERM / Ctrl-C.

    Args:
        engine_config: the engine's settings (model None: the demo model).
        server_config: host, port, key, served name, shutdown grace period, logging.
    Returns:
        0 once the server has stopped.
    """
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    engine = AsyncLLM.from_config(
        engine_config,
        served_model_name=server_config.served_model_name,
        log_stats_interval_s=server_config.log_stats_interval,
    )
    app = build_app(engine, api_key=server_config.api_key)
    grace = server_config.shutdown_timeout
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        # A backstop only: our own deadline aborts what is left after `grace` seconds.
        timeout_graceful_shutdown=math.ceil(grace) + 5,
    )
    logger.info(
        "Serving %s as %r on http://%s:%d (max_model_len %d, API key %s)",
        engine.model_path,
        engine.model_name,
        server_config.host,
        server_config.port,
        engine.max_model_len,
        "required" if server_config.api_key else "not required",
    )
    server = _GracefulServer(config, engine, grace)
    # uvicorn re-raises a captured Ctrl-C once it has shut down: that is a normal exit.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0


class _GracefulServer(uvicorn.Server):
    """uvicorn.Server whose exit signal also starts the engine's shutdown grace period."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self._loop is not None:
            logger.info(
                "Shutting down: no new requests; in-flight ones have %.0f s to finish.",
                self._grace,
            )
            # Signal handlers run between bytecodes of the loop's thread: hand over safely.
            self._loop.call_soon_threadsafe(self._engine.begin_shutdown, self._grace)

"""The FastAPI app: routes, API-key check, lifespan of the engine loop.

    /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize  need the key
    /health (200, or 503 when the engine is dead), /version, /metrics           stay open
Handlers never block: the model runs in AsyncLLM's engine process (or thread); errors go
through errors.py.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from conveyor import __version__
from conveyor.entrypoints.async_llm import AsyncLLM, EngineNotRunningError
from conveyor.server.admission import BodySizeLimit
from conveyor.server.chat import create_chat_completion
from conveyor.server.completions import create_completion
from conveyor.server.config import ServerConfig
from conveyor.server.context import ServingContext
from conveyor.server.errors import APIError, error_body, error_response, install_error_handlers
from conveyor.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from conveyor.server.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from conveyor.server.streaming import until_disconnected

_OPEN_PATHS = ("/health", "/version", "/metrics", "/ping")

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class _APIKeyMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): every path except the
    open ones needs `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        message = "Missing or invalid API key: send the header 'Authorization: Bearer <key>'."
        await JSONResponse(error_body(message, 401), status_code=401)(scope, receive, send)


def build_app(
    engine: AsyncLLM, api_key: str | None = None, config: ServerConfig | None = None
) -> FastAPI:
    """Build the OpenAI-compatible app around an AsyncLLM.

    Args:
        engine: the engine; the app's lifespan starts its loop and shuts it down.
        api_key: when set, every route but /health, /version and /metrics needs
            `Authorization: Bearer <api_key>` (default: config.api_key).
        config: the limits (max_n, max_request_body_bytes, request_timeout); the
            engine holds max_waiting_requests. Default: ServerConfig's defaults.
    Returns:
        The FastAPI app (serve it with uvicorn).
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="conveyor", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    config = config or ServerConfig()
    api_key = api_key or config.api_key
    ctx = ServingContext(
        engine,
        engine.model_name,
        engine.model_path,
        config.max_n,
        config.request_timeout,
        aliases=tuple(engine.served_model_names[1:]),
    )
    app.state.ctx = ctx

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await until_disconnected(raw, create_completion(ctx, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await until_disconnected(raw, create_chat_completion(ctx, body))

    @app.get("/v1/models")
    async def models() -> ModelList:
        # One card per served name, as vLLM lists its aliases.
        root, max_len = ctx.model_path, engine.max_model_len
        return ModelList(
            data=[ModelCard(id=name, root=root, max_model_len=max_len) for name in ctx.served_names]
        )

    @app.get("/health")
    async def health() -> Response:
        try:
            engine.check_health()
        except EngineNotRunningError as exc:
            return error_response(str(exc), 503)
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("Give exactly one of `prompt` and `messages`.", param="prompt")
        if body.messages is not None:
            ids = ctx.render_chat(body.messages, bool(body.add_generation_prompt))
        else:
            ids = engine.tokenizer.encode(body.prompt or "", bool(body.add_special_tokens))
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        vocab = engine.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"Token ids must be in [0, {vocab}); got {bad}.", param="tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    # Added last, so outermost: an oversized body is refused before anything else runs.
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)
    return app

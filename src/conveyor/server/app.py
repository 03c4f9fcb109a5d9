"""The FastAPI app: routes, API-key check, lifespan of the engine loop.

    /v1/completions, /v1/chat/completions, /v1/responses (POST; GET and DELETE
    /v1/responses/{id}), /v1/embeddings, /v1/models, /v1/models/{id},
    /tokenize, /detokenize        need a key
    /metrics                      needs it too with metrics_require_api_key
    /health, /ping (GET or HEAD: 200 with {"replicas": N, "serving": M}, or 503 when the
    engine is dead, hung, shutting down, or no replica serves),  /version       stay open
Handlers never block: the model runs in AsyncLLM's engine process (or thread), long text work
in server/offload.py's threads; errors go through errors.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from conveyor import __version__
from conveyor.entrypoints.async_llm import AsyncLLM, EngineNotRunningError
from conveyor.server.admission import BodySizeLimit, install_client_limits
from conveyor.server.body_checks import BodyCheckedRoute
from conveyor.server.chat import create_chat_completion
from conveyor.server.clients import ClientIdentity
from conveyor.server.completions import create_completion
from conveyor.server.config import ServerConfig
from conveyor.server.context import ServingContext
from conveyor.server.embeddings import EmbeddingRequest, create_embedding
from conveyor.server.errors import APIError, error_body, error_response, install_error_handlers
from conveyor.server.offload import INLINE_TOKENS, maybe_off_loop
from conveyor.server.openapi import document_errors_as_400
from conveyor.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from conveyor.server.reasoning import choose_reasoning_parser
from conveyor.server.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from conveyor.server.responses_api import ResponseStore, create_response
from conveyor.server.responses_protocol import ResponsesRequest
from conveyor.server.streaming import until_disconnected
from conveyor.server.tenancy import bearer_credentials, tenant_salt
from conveyor.structured.grammar_checker import GrammarChecker

_OPEN_PATHS = ("/health", "/version", "/metrics", "/ping")

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class _APIKeyMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): every path except the
    open ones needs `Authorization: Bearer <key>` with one of the keys. The scheme is
    case-insensitive (RFC 7235); the key is compared with every key, each in constant time."""

    def __init__(self, app: ASGIApp, api_keys: list[str], open_paths: tuple[str, ...]) -> None:
        self.app = app
        self._expected = [k.encode() for k in api_keys]
        self._open_paths = open_paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths:
            await self.app(scope, receive, send)
            return
        given = bearer_credentials(dict(scope["headers"]).get(b"authorization", b""))
        matches = [hmac.compare_digest(given, key) for key in self._expected]
        if given and any(matches):
            await self.app(scope, receive, send)
            return
        message = "Missing or invalid API key: send the header 'Authorization: Bearer <key>'."
        await JSONResponse(error_body(message, 401), status_code=401)(scope, receive, send)


class _ShutdownCut:
    """Pure ASGI: uvicorn cancels the requests still running its graceful-shutdown timeout
    after SIGTERM (launch.py: the grace period + 5 s) and answers each with a bare 500. One
    cut so before its response started gets the 503 that every request refused while the
    server stops gets instead (a started response is only ended, as before)."""

    def __init__(self, app: ASGIApp, engine: AsyncLLM) -> None:
        self.app = app
        self._engine = engine

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
            return
        except asyncio.CancelledError:
            reason = self._not_serving()
            if started or reason is None:  # not the server stopping: not ours to answer
                raise
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # 3.11+ counts cancellations
                task.uncancel()  # handled: answered below
        await error_response(reason, 503)(scope, receive, send)

    def _not_serving(self) -> str | None:
        try:
            self._engine.check_health()
        except EngineNotRunningError as exc:
            return str(exc)
        return None


def build_app(
    engine: AsyncLLM, api_key: str | list[str] | None = None, config: ServerConfig | None = None
) -> FastAPI:
    """Build the OpenAI-compatible app around an AsyncLLM.

    Args:
        engine: the engine; the app's lifespan starts its loop and shuts it down.
        api_key: a key or a list of keys; when set, every route but /health, /ping,
            /version and (unless config.metrics_require_api_key) /metrics needs
            `Authorization: Bearer <one of them>` (default: config.api_key).
        config: the limits (max_n, max_prompts_per_request, max_request_body_bytes,
            request_timeout), trust_request_chat_template and cache_salt_from (each tenant's
            requests get their own prefix-cache salt, server/tenancy.py); the engine holds
            max_waiting_requests. Default: ServerConfig's defaults.
    Returns:
        The FastAPI app (serve it with uvicorn).
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            grammars.close()  # kills checks in flight: shutdown never waits for a compile
            await engine.shutdown()

    app = FastAPI(title="conveyor", version=__version__, lifespan=lifespan)
    app.router.route_class = BodyCheckedRoute  # every route below: body checks before pydantic
    install_error_handlers(app)
    config = config or ServerConfig()
    app.state.max_chat_messages = config.max_chat_messages  # read before pydantic
    if api_key:
        api_keys = [api_key] if isinstance(api_key, str) else list(api_key)
    else:
        api_keys = config.api_keys
    # Several keys, no --cache-salt-from: each key its own cache (server/tenancy.py).
    tenancy = tenant_salt(config.cache_salt_from, len(api_keys))
    grammars = GrammarChecker(
        engine.tokenizer.hf,
        engine.vocab_size,
        engine.tokenizer.eos_token_ids,
        engine.grammar_compile_timeout,
        memory_mb=config.grammar_memory_limit,
        workers=config.grammar_check_workers,
        max_per_client=config.grammar_checks_per_client,
    )
    ctx = ServingContext(
        engine,
        engine.model_name,
        engine.model_path,
        config.max_n,
        config.request_timeout,
        aliases=tuple(engine.served_model_names[1:]),
        max_prompts=config.max_prompts_per_request,
        max_chat_messages=config.max_chat_messages,
        trust_request_chat_template=config.trust_request_chat_template,
        tool_call_parser=config.tool_call_parser,
        grammars=grammars,
        reasoning_parser=choose_reasoning_parser(
            config.reasoning_parser, getattr(engine, "tokenizer", None)
        ),
    )
    app.state.ctx = ctx
    app.state.grammars = grammars  # launch.py kills its checks when a drain's grace ends

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        if tenancy is not None:
            body.cache_salt = tenancy.cache_salt(raw.scope["headers"], body.cache_salt)
        return await until_disconnected(raw, create_completion(ctx, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        if tenancy is not None:
            body.cache_salt = tenancy.cache_salt(raw.scope["headers"], body.cache_salt)
        return await until_disconnected(raw, create_chat_completion(ctx, body))

    store = ResponseStore(  # /v1/responses' stored responses (server/response_store.py)
        config.responses_store_bytes,
        config.responses_store_tenant_bytes,
        config.responses_store_entry_bytes,
    )

    def owner(raw: Request) -> bytes:
        """Whose stored responses a request may see: its tenant's, or its key's."""
        headers = raw.scope["headers"]
        if tenancy is not None:
            tenant = tenancy.tenant(headers)
        elif api_keys:
            tenant = bearer_credentials(dict(headers).get(b"authorization", b""))
        else:
            return b""
        return hashlib.sha256(b"conveyor-response-owner\x00" + tenant).digest()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        if tenancy is not None:
            body.cache_salt = tenancy.cache_salt(raw.scope["headers"], body.cache_salt)
        return await until_disconnected(raw, create_response(ctx, store, body, owner(raw)))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw: Request) -> Response:
        # Kept as the JSON it is served as (server/response_store.py).
        return Response(store.get(response_id, owner(raw)), media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request) -> Response:
        store.delete(response_id, owner(raw))
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        if tenancy is not None:
            body.cache_salt = tenancy.cache_salt(raw.scope["headers"], body.cache_salt)
        return await until_disconnected(raw, create_embedding(ctx, body))

    @app.get("/v1/models")
    async def models() -> ModelList:
        # One card per served name, as vLLM lists its aliases.
        root, max_len = ctx.model_path, engine.max_model_len
        return ModelList(
            data=[ModelCard(id=name, root=root, max_model_len=max_len) for name in ctx.served_names]
        )

    # `:path`: served names may hold slashes ("Org/Model"), as vLLM's often do.
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        ctx.check_model(model_id)  # 404 naming the served ones
        return ModelCard(id=model_id, root=ctx.model_path, max_model_len=engine.max_model_len)

    # HEAD too: load balancers probe with it (the same status and headers, no body).
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        try:
            engine.check_health()
        except EngineNotRunningError as exc:
            return error_response(str(exc), 503)
        # Degraded data parallelism: healthy while one replica serves; the body says how many.
        return JSONResponse(
            {"replicas": engine.num_replicas, "serving": engine.num_serving_replicas}
        )

    @app.api_route("/ping", methods=["GET", "HEAD"])
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
            ids = await ctx.render_chat(body.messages, bool(body.add_generation_prompt))
        else:
            ids = await ctx.tokenize_prompt(body.prompt or "", bool(body.add_special_tokens))
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        vocab = engine.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"Token ids must be in [0, {vocab}); got {bad}.", param="tokens")
        decode = engine.tokenizer.decode
        text = await maybe_off_loop(len(body.tokens), INLINE_TOKENS, decode, body.tokens)
        return DetokenizeResponse(prompt=text)

    document_errors_as_400(app)
    # Innermost: whatever stage a request is in when shutdown cuts it, it gets a 503.
    app.add_middleware(_ShutdownCut, engine=engine)
    if api_keys:
        open_paths = tuple(
            p for p in _OPEN_PATHS if p != "/metrics" or not config.metrics_require_api_key
        )
        app.add_middleware(_APIKeyMiddleware, api_keys=api_keys, open_paths=open_paths)
    # Sequences and tokens in flight per client (max_client_sequences / _tokens).
    install_client_limits(app, engine, config)
    # Whose request it is: per-client limits, grammar checks and the scheduler's tenants.
    tenant_header = None
    if tenancy is not None and not tenancy.from_api_key and not api_keys:
        tenant_header = tenancy.header
    app.add_middleware(ClientIdentity, tenant_header=tenant_header)
    # Added last, so outermost: an oversized body is refused before anything else runs.
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)
    return app

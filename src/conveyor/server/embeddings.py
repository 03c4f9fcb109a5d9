"""POST /v1/embeddings: OpenAI's embeddings API over the engine's pooled hidden states.

    input: "text" | ["text", ...] | [token ids] | [[token ids], ...]
        ──► one engine request per input (SamplingParams.pooling), batched and chunked with
            every other request's steps ──► the final hidden states pooled (the model's
            pooling: its sentence-transformers config, else the last token), L2-normalized
        ──► {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
             "model": ..., "usage": {"prompt_tokens": N, "total_tokens": N}}

`encoding_format` "base64" gives each vector as the base64 of its little-endian float32 bytes
(as OpenAI; the official client asks for it by default and decodes it). `dimensions` shortens
the vectors of a Matryoshka model (cut, then renormalized); any other model refuses it unless
it equals the model's size. `user` is an accepted hint (no effect); any field not listed here
is a 400 naming it, not ignored.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi.responses import Response
from pydantic import ConfigDict, Field

from conveyor.engine.outputs import RequestOutput
from conveyor.pooling_params import PoolingParams
from conveyor.sampling_params import SamplingParams
from conveyor.server.clients import current_client, request_arrival
from conveyor.server.context import ServingContext
from conveyor.server.errors import APIError
from conveyor.server.offload import off_loop
from conveyor.server.protocol import Bool, Int, OpenAIModel
from conveyor.server.responses import random_id
from conveyor.server.streaming import merge_streams

# Above this many floats in a response, encoding it runs off the event loop.
_INLINE_FLOATS = 1 << 16


class EmbeddingRequest(OpenAIModel):
    """OpenAI's embeddings request, plus vLLM's `add_special_tokens`, `priority` and
    `cache_salt`. Unknown fields are refused (400 naming the field)."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[Int] | list[list[Int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: Annotated[Int, Field(ge=1)] | None = None
    user: str | None = None  # a hint for abuse monitoring: accepted, no effect
    add_special_tokens: Bool | None = True
    priority: Int | None = 0
    cache_salt: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list of texts or token-id lists (OpenAI's four shapes)."""
        value = self.input
        if isinstance(value, str):
            items: list[str | list[int]] = [value]
        elif value and all(isinstance(t, int) for t in value):
            items = [list(value)]  # type: ignore[arg-type]
        else:
            items = list(value)  # type: ignore[arg-type]
        if not items:
            raise APIError("input must not be empty.", param="input")
        for i, item in enumerate(items):
            if len(item) == 0:
                what = "string" if isinstance(item, str) else "token list"
                where = "input" if len(items) == 1 else f"input[{i}]"
                raise APIError(f"{where} is an empty {what}: embed at least one token.", "input")
        return items


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the response carries it: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def _render(vectors: list[list[float]], encoding_format: str, model: str, num_tokens: int) -> bytes:
    body = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _not_computed(index: int, out: RequestOutput) -> APIError:
    """The error for an input the engine aborted: 408 when its deadline (the server's
    request_timeout) passed, 503 when the server is shutting down. A generation would end
    with finish_reason "abort"; an embedding has no partial answer to give."""
    reason = next((c.abort_reason for c in out.outputs if c.abort_reason), None)
    status = 408 if reason and reason.startswith("deadline exceeded") else 503
    message = f"The embedding of input {index} was not computed: {reason or 'aborted'}."
    return APIError(message, status=status)


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest) -> Response:
    """Validate everything, queue one engine request per input, answer with the vectors.

    Raises:
        APIError / ValueError: a bad request (nothing is queued then).
    """
    ctx.check_model(req.model)
    engine = ctx.engine
    pooling_config = engine.pooling
    if pooling_config is not None:
        try:
            pooling_config.check_request(req.dimensions)
        except ValueError as exc:
            param = "dimensions" if str(exc).startswith("dimensions") else "model"
            raise APIError(str(exc), param=param) from exc
    try:
        params = SamplingParams(
            max_tokens=1,
            priority=req.priority or 0,
            cache_salt=req.cache_salt,
            pooling=PoolingParams(dimensions=req.dimensions),
        )
    except ValueError as exc:  # the field's name leads the message
        raise APIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc
    params = ctx.with_timeout(params)
    inputs = req.inputs()
    if ctx.max_prompts is not None and len(inputs) > ctx.max_prompts:
        raise APIError(
            f"input must hold at most {ctx.max_prompts} inputs on this server, got {len(inputs)}.",
            param="input",
        )
    add_special = req.add_special_tokens is not False
    for item in inputs:  # before any is tokenized
        if isinstance(item, str):
            ctx.check_text_length(len(item), "input")
    prompt_ids = [await ctx.tokenize_prompt(item, add_special) for item in inputs]
    for ids in prompt_ids:  # every input is checked before any is queued
        ctx.check_fits(ids, params, "input")
    engine.check_admission(len(inputs))
    request_id = random_id("embd")
    streams: list[AsyncIterator[RequestOutput]] = [
        engine.generate(
            ids,
            params,
            f"{request_id}-{i}",
            arrival_time=request_arrival(),
            tenant=current_client(),
        )
        for i, ids in enumerate(prompt_ids)
    ]
    vectors: list[list[float] | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        if out.finished:
            vectors[i] = out.embedding
            if out.embedding is None:  # aborted: the request timeout, or shutting down
                raise _not_computed(i, out)
    done: list[list[float]] = [v for v in vectors if v is not None]
    num_tokens = sum(len(ids) for ids in prompt_ids)
    fmt = req.encoding_format or "float"
    size = sum(len(v) for v in done)
    if size > _INLINE_FLOATS:
        content = await off_loop(_render, done, fmt, ctx.model_name, num_tokens)
    else:
        content = _render(done, fmt, ctx.model_name, num_tokens)
    return Response(content, media_type="application/json")

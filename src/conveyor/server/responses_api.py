"""POST /v1/responses (OpenAI's Responses API) on the chat path, and its bounded store.

A request is rewritten into a chat completion request (server/responses_protocol.py) and
checked, rendered and constrained by server/chat.py's `prepare_chat`, exactly as a chat
request; its answer is read as chat reads it (the reasoning split first, then tool calls) and
written as Responses output items, whole or streamed (server/responses_stream.py).

    status  "completed"; "incomplete" (incomplete_details.reason "max_output_tokens") when
            the answer reached max_output_tokens or the context; "failed" (error) when the
            engine aborted it (its deadline, the server's --request-timeout)
    usage   input_tokens (cached_tokens: the prefix cache's), output_tokens (reasoning_tokens:
            the thinking's text re-tokenized, an estimate within a token or two), total_tokens

`store` (OpenAI's default: true) keeps the response in memory (server/response_store.py:
bounded in bytes, each tenant its own quota): `previous_response_id` continues its
conversation (its inputs and outputs come before the new input; its instructions do not), GET
and DELETE /v1/responses/{id} read and drop it. An evicted or unknown id is a 404, and so is
another tenant's (with --api-key: another key's; with --cache-salt-from: another tenant's).
A response too big for one entry (--responses-store-entry-bytes) is not stored: a 400 before
anything runs when the request set `store: true` itself and its input alone is too big, else
answered with `store: false` (as vLLM answers when its store is off). Nothing survives a
restart, and data-parallel replicas share the one store of the API server.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.server.chat import ChatPlan, prepare_chat, whole_output
from conveyor.server.clients import current_client, request_arrival
from conveyor.server.constraints import relabeled
from conveyor.server.context import ServingContext
from conveyor.server.errors import APIError
from conveyor.server.offload import INLINE_CHARS, INLINE_TOKENS, maybe_off_loop
from conveyor.server.response_store import ResponseStore
from conveyor.server.responses_input import input_messages
from conveyor.server.responses_protocol import CHAT_TO_RESPONSES, ResponsesRequest, to_chat_request
from conveyor.server.responses_stream import ResponseEvents, item_id, output_items
from conveyor.server.streaming import sse_response

# Chat's names in error messages, as the Responses request calls them.
_RENAMED_IN_MESSAGES = {
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "reasoning_effort=": "reasoning.effort=",
}
_JSON = "application/json"


async def create_response(
    ctx: ServingContext, store: ResponseStore, req: ResponsesRequest, owner: bytes = b""
) -> Response:
    """Map onto the chat path, queue, answer as a response object or as its SSE events.

    Args:
        owner: the request's tenant (hashed), whose stored responses it may continue.

    Raises:
        APIError / ValueError: a bad request (nothing is queued then).
    """
    req.check()
    previous = req.previous_response_id
    history = await _history(store, previous, owner) if previous else []
    try:
        plan = await prepare_chat(ctx, to_chat_request(req, history))
    except APIError as exc:
        raise _renamed(exc) from None
    response_id = item_id("resp")
    response = _skeleton(ctx, req, response_id)
    turn = input_messages(req.input)
    size_hint = len(plan.prompt_ids)  # tokens: how big its JSON may be, to encode it off loop
    if req.store:
        response["store"] = await _storable(store, req, response, turn, size_hint)
    ctx.admit(plan.params.n)
    param = CHAT_TO_RESPONSES.get(plan.param or "", plan.param)
    stream = relabeled(
        ctx.engine.generate(
            plan.prompt_ids,
            plan.params,
            response_id,
            arrival_time=request_arrival(),
            tenant=current_client(),
        ),
        param,
    )
    if req.stream:
        events = _events(ctx, store, stream, plan, response, turn, owner)
        return sse_response(events, done=False)
    final = await whole_output(stream)
    c = final.outputs[0]
    thinking, text = None, c.text
    if plan.reasoning is not None:  # tool calls are read from the answer after its thinking
        thinking, text = plan.reasoning.split(text)
    content, calls = text, []
    if plan.tools is not None:  # harmony's (markup) reads its channels from the whole answer
        content, calls, _ = plan.tools.read(c.text if plan.tools.markup else text, c.finish_reason)
    status, details = _status(c)
    response.update(
        status=status,
        output=output_items(thinking, content, calls, _item_status(status)),
        usage=await _usage(ctx, len(plan.prompt_ids), c, final.num_cached_tokens, thinking),
        **details,
    )
    size_hint += len(c.token_ids)
    body = await _put(store, response, previous, turn, owner, size_hint)
    if body is None:
        (body,) = await maybe_off_loop(size_hint, INLINE_TOKENS, _json, response)
    return Response(body, media_type=_JSON)


async def _history(store: ResponseStore, previous: str, owner: bytes) -> list[dict[str, Any]]:
    """The messages of the stored conversation `previous` ends (404 if it is not stored)."""
    turns = store.history(previous, owner)
    size = sum(len(t) for t in turns)
    return await maybe_off_loop(size, INLINE_CHARS, _messages_of, turns)


def _messages_of(turns: list[bytes]) -> list[dict[str, Any]]:
    return [m for turn in turns for m in json.loads(turn)]


def _json(*values: Any) -> list[bytes]:
    """Each value's JSON, as JSONResponse writes it (so a stored response is served as is)."""
    return [
        json.dumps(v, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        for v in values
    ]


async def _storable(
    store: ResponseStore,
    req: ResponsesRequest,
    response: dict[str, Any],
    turn: list[dict[str, Any]],
    size_hint: int,
) -> bool:
    """Whether the response may be stored, as far as its request tells (the output adds to
    it). Too big: not stored, or a 400 when the request set `store: true` itself.

    Raises:
        APIError: 400 (param store), the request alone is over the store's entry cap.
    """
    size = sum(map(len, await maybe_off_loop(size_hint, INLINE_TOKENS, _json, response, turn)))
    if store.fits(size):
        return True
    if "store" in req.model_fields_set:
        raise APIError(
            f"store=true was refused: this response would take over {size} bytes (its input "
            "and settings as JSON), more than one stored response may hold on this server "
            f"({store.entry_bytes}, --responses-store-entry-bytes). Send store false, or less.",
            param="store",
        )
    return False


async def _put(
    store: ResponseStore,
    response: dict[str, Any],
    previous: str | None,
    turn: list[dict[str, Any]],
    owner: bytes,
    size_hint: int,
) -> bytes | None:
    """Store a finished response whose `store` is true: its JSON as stored (and sent), or
    None, not stored (its `store` is false then: it did not fit, or was not asked for)."""
    if not response["store"]:
        return None
    messages = turn + input_messages(response["output"])
    body, turn_json = await maybe_off_loop(size_hint, INLINE_TOKENS, _json, response, messages)
    if store.put(response["id"], body, turn_json, previous, owner):
        return body
    response["store"] = False
    return None


async def _events(
    ctx: ServingContext,
    store: ResponseStore,
    stream: AsyncIterator[RequestOutput],
    plan: ChatPlan,
    response: dict[str, Any],
    turn: list[dict[str, Any]],
    owner: bytes,
) -> AsyncIterator[str]:
    events = ResponseEvents(response, plan.tools, plan.reasoning)
    for event in events.openings():
        yield event
    last: CompletionOutput | None = None
    cached, num_generated = 0, 0
    async for out in stream:
        cached = out.num_cached_tokens
        for c in out.outputs:
            if last is not None and last.finish_reason is not None:
                continue  # a finished answer's later outputs
            last, num_generated = c, num_generated + len(c.token_ids)
            for event in events.feed(c.text, c.finish_reason):
                yield event
    assert last is not None
    status, details = _status(last)
    counts = await _usage(ctx, len(plan.prompt_ids), last, cached, events.thinking or None)
    counts["output_tokens"] = num_generated
    counts["output_tokens_details"]["reasoning_tokens"] = min(
        counts["output_tokens_details"]["reasoning_tokens"], num_generated
    )
    counts["total_tokens"] = counts["input_tokens"] + num_generated
    for event in events.done(status, counts, details):
        yield event
    size_hint = len(plan.prompt_ids) + num_generated
    await _put(store, events.response, response["previous_response_id"], turn, owner, size_hint)
    yield events.last()  # its `store` says whether it was stored


def _item_status(status: str) -> str:
    """The last output item's status: an answer cut off is an incomplete item."""
    return "completed" if status == "completed" else "incomplete"


def _status(c: CompletionOutput) -> tuple[str, dict[str, Any]]:
    """The response's status and the fields that explain it."""
    if c.finish_reason == "length":
        return "incomplete", {"incomplete_details": {"reason": "max_output_tokens"}}
    if c.finish_reason == "abort":
        why = c.abort_reason or "the request was aborted"
        return "failed", {"error": {"code": "server_error", "message": why}}
    return "completed", {}


async def _usage(
    ctx: ServingContext,
    num_prompt: int,
    c: CompletionOutput,
    num_cached: int,
    thinking: str | None,
) -> dict[str, Any]:
    num_generated = len(c.token_ids)
    num_reasoning = 0
    if thinking:
        encode = ctx.engine.tokenizer.encode
        ids = await maybe_off_loop(len(thinking), INLINE_CHARS, encode, thinking, False)
        num_reasoning = min(len(ids), num_generated)
    return {
        "input_tokens": num_prompt,
        "input_tokens_details": {"cached_tokens": num_cached},
        "output_tokens": num_generated,
        "output_tokens_details": {"reasoning_tokens": num_reasoning},
        "total_tokens": num_prompt + num_generated,
    }


def _skeleton(ctx: ServingContext, req: ResponsesRequest, response_id: str) -> dict[str, Any]:
    """The response object before its output: the request's settings echoed back."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": ctx.model_name,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.echoed_reasoning(),
        "store": bool(req.store),
        "temperature": req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
    }


def _renamed(exc: APIError) -> APIError:
    """A chat path's 400 in the Responses request's own field names."""
    param = CHAT_TO_RESPONSES.get(exc.param or "", exc.param)
    if param == "max_tokens":
        param = "max_output_tokens"
    message = exc.message
    for chat_name, name in _RENAMED_IN_MESSAGES.items():
        message = message.replace(chat_name, name)
    return APIError(message, param=param, status=exc.status)

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

`store` (OpenAI's default: true) keeps the response in memory, in a least-recently-used
store of STORE_SIZE responses: `previous_response_id` continues its conversation (its inputs
and outputs come before the new input; its instructions do not), GET and DELETE
/v1/responses/{id} read and drop it. An evicted or unknown id is a 404, and so is another
tenant's (with --api-key: another key's; with --cache-salt-from: another tenant's). Nothing
survives a restart, and data-parallel replicas share the one store of the API server.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response

from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.server.chat import ChatPlan, prepare_chat, whole_output
from conveyor.server.context import ServingContext
from conveyor.server.errors import APIError
from conveyor.server.offload import INLINE_CHARS, maybe_off_loop
from conveyor.server.responses_protocol import (
    CHAT_TO_RESPONSES,
    ResponsesRequest,
    input_messages,
    to_chat_request,
)
from conveyor.server.responses_stream import ResponseEvents, item_id, output_items
from conveyor.server.streaming import sse_response
from conveyor.structured.request import relabeled

STORE_SIZE = 256

# Chat's names in error messages, as the Responses request calls them.
_RENAMED_IN_MESSAGES = {
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "reasoning_effort=": "reasoning.effort=",
}


@dataclass(slots=True)
class _Stored:
    response: dict[str, Any]
    previous: str | None
    messages: list[dict[str, Any]]  # this turn's input and output, as chat messages
    owner: bytes  # a hash of the tenant that created it (b"": a server without tenants)


class ResponseStore:
    """The last `size` stored responses by id, least recently used evicted first; each is
    seen only by its owner (`owner`: a hash of the request's tenant, b"" without tenants)."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self._size = size
        self._entries: OrderedDict[str, _Stored] = OrderedDict()

    def put(
        self, response: dict[str, Any], previous: str | None, messages: list[dict], owner: bytes
    ) -> None:
        self._entries[response["id"]] = _Stored(response, previous, messages, owner)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def _entry(self, response_id: str, owner: bytes, param: str | None = None) -> _Stored:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            raise APIError(
                f"No stored response with id {response_id[:80]!r} (this server keeps the last "
                f"{self._size} responses created with store true, in memory).",
                param=param,
                status=404,
            )
        self._entries.move_to_end(response_id)
        return entry

    def get(self, response_id: str, owner: bytes) -> dict[str, Any]:
        return self._entry(response_id, owner).response

    def delete(self, response_id: str, owner: bytes) -> None:
        self._entry(response_id, owner)
        del self._entries[response_id]

    def history(self, response_id: str, owner: bytes) -> list[dict[str, Any]]:
        """The messages of the conversation up to and including `response_id`'s answer."""
        turns, seen = [], set()
        next_id: str | None = response_id
        while next_id is not None and next_id not in seen:
            seen.add(next_id)
            entry = self._entry(next_id, owner, "previous_response_id")
            turns.append(entry.messages)
            next_id = entry.previous
        return [m for turn in reversed(turns) for m in turn]


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
    history = store.history(previous, owner) if previous else []
    try:
        plan = await prepare_chat(ctx, to_chat_request(req, history))
    except APIError as exc:
        raise _renamed(exc) from None
    ctx.admit(plan.params.n)
    response_id = item_id("resp")
    param = CHAT_TO_RESPONSES.get(plan.param or "", plan.param)
    stream = relabeled(ctx.engine.generate(plan.prompt_ids, plan.params, response_id), param)
    response = _skeleton(ctx, req, response_id)
    turn = input_messages(req.input)
    if req.stream:
        events = _events(ctx, store, req, stream, plan, response, turn, owner)
        return sse_response(events, done=False)
    final = await whole_output(stream)
    c = final.outputs[0]
    thinking, text = None, c.text
    if plan.reasoning is not None:  # tool calls are read from the answer after its thinking
        thinking, text = plan.reasoning.split(text)
    content, calls = text, []
    if plan.tools is not None:
        content, calls, _ = plan.tools.read(text, c.finish_reason)
    status, details = _status(c)
    response.update(
        status=status,
        output=output_items(thinking, content, calls, _item_status(status)),
        usage=await _usage(ctx, len(plan.prompt_ids), c, final.num_cached_tokens, thinking),
        **details,
    )
    if req.store:
        store.put(response, previous, turn + input_messages(response["output"]), owner)
    return JSONResponse(response)


async def _events(
    ctx: ServingContext,
    store: ResponseStore,
    req: ResponsesRequest,
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
            for event in events.feed(c.text, c.finish_reason is not None):
                yield event
    assert last is not None
    status, details = _status(last)
    counts = await _usage(ctx, len(plan.prompt_ids), last, cached, events.thinking or None)
    counts["output_tokens"] = num_generated
    counts["output_tokens_details"]["reasoning_tokens"] = min(
        counts["output_tokens_details"]["reasoning_tokens"], num_generated
    )
    counts["total_tokens"] = counts["input_tokens"] + num_generated
    for event in events.close(status, counts, details):
        yield event
    if req.store:
        output = events.response["output"]
        store.put(events.response, req.previous_response_id, turn + input_messages(output), owner)


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
        "reasoning": req.reasoning or {"effort": None, "summary": None},
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

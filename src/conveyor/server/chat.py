"""POST /v1/chat/completions: messages through the chat template, one engine request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response

from conveyor.outputs import Logprob, RequestOutput
from conveyor.sampling_params import MAX_LOGPROBS
from conveyor.server.context import ServingContext
from conveyor.server.errors import APIError
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.responses import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatResponseMessage,
    random_id,
    stop_reason,
    usage,
)
from conveyor.server.sse import ChatChunks
from conveyor.server.streaming import sse_response


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest) -> Response:
    """Validate, render the chat template, queue the request, answer as JSON or as SSE.

    Raises:
        APIError / ValueError: a bad request (nothing is queued then).
    """
    ctx.check_model(req.model)
    req.check_common()
    req.check_chat()
    top = None
    if req.logprobs:
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise APIError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}.", param="top_logprobs"
            )
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = req.max_tokens
    params = ctx.with_timeout(req.sampling_params(max_tokens, top))
    prompt_ids = ctx.render_chat(
        req.messages, bool(req.add_generation_prompt), req.chat_template_kwargs
    )
    ctx.check_fits(prompt_ids, max_tokens, params, "messages")
    ctx.admit(params.n)
    request_id = random_id("chatcmpl")
    stream = ctx.engine.generate(prompt_ids, params, request_id)
    if req.stream:
        opts = req.stream_options
        events = _stream(
            ctx,
            request_id,
            stream,
            params.n,
            top,
            len(prompt_ids),
            include_usage=bool(opts and opts.include_usage),
            continuous_usage=bool(opts and opts.include_usage and opts.continuous_usage_stats),
        )
        return sse_response(events)

    final: RequestOutput | None = None
    async for out in stream:
        if final is None:
            final = out
        else:
            final.add(out)
    assert final is not None  # a stream always ends with a finished output
    choices = [
        ChatCompletionResponseChoice(
            index=c.index,
            message=ChatResponseMessage(content=c.text),
            logprobs=None
            if top is None or c.logprobs is None
            else chat_logprobs(c.token_ids, c.logprobs, top),
            finish_reason=c.finish_reason,
            stop_reason=stop_reason(c),
        )
        for c in final.outputs
    ]
    num_generated = sum(len(c.token_ids) for c in final.outputs)
    body = ChatCompletionResponse(
        id=request_id,
        model=ctx.model_name,
        choices=choices,
        usage=usage(len(prompt_ids), num_generated),
    )
    return JSONResponse(body.model_dump())


async def _stream(
    ctx: ServingContext,
    request_id: str,
    stream: AsyncIterator[RequestOutput],
    n: int,
    top: int | None,
    num_prompt_tokens: int,
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncIterator[str]:
    chunks = ChatChunks(
        request_id, int(time.time()), ctx.model_name, num_prompt_tokens, continuous_usage
    )
    # The first chunk of every choice carries the role, before any token is made.
    for i in range(n):
        yield chunks.role(i)
    num_generated = 0
    finished = [False] * n
    async for out in stream:
        for c in out.outputs:
            if finished[c.index]:
                continue
            finished[c.index] = c.finish_reason is not None
            if not (c.text or c.token_ids or finished[c.index]):
                continue  # held-back text (a possible stop string): nothing to send yet
            num_generated += len(c.token_ids)
            # OpenAI's last chunk has an empty delta unless it still carries text.
            content = c.text if c.text or not finished[c.index] else None
            logprobs = None
            if top is not None and c.logprobs is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs, top)
            yield chunks.choice(
                c.index, content, logprobs, c.finish_reason, stop_reason(c), num_generated
            )
    if include_usage:
        yield chunks.usage(num_generated)


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], top: int
) -> ChatLogProbs:
    """The chat logprobs object: per token its logprob, UTF-8 bytes and the `top` best."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry[token_id]
        best = sorted(entry.values(), key=lambda lp: lp.logprob, reverse=True)[:top]
        content.append(
            ChatLogProbsContent(
                token=sampled.decoded_token or "",
                logprob=max(sampled.logprob, -9999.0),
                bytes=list((sampled.decoded_token or "").encode("utf-8", errors="replace")),
                top_logprobs=[_chat_logprob(lp) for lp in best],
            )
        )
    return ChatLogProbs(content=content)


def _chat_logprob(lp: Logprob) -> ChatLogProb:
    token = lp.decoded_token or ""
    return ChatLogProb(
        token=token,
        logprob=max(lp.logprob, -9999.0),
        bytes=list(token.encode("utf-8", errors="replace")),
    )

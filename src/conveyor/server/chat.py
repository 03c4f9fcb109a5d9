"""POST /v1/chat/completions: messages through the chat template, one engine request."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse, Response

from conveyor.engine.outputs import CompletionOutput, Logprob, RequestOutput
from conveyor.sampling_params import MAX_LOGPROBS, SamplingParams
from conveyor.server.choice_stream import ChunkEvents, stream_choices, usage_flags
from conveyor.server.clients import current_client, request_arrival
from conveyor.server.constraints import (
    DeadlinePassedError,
    checked_structured_outputs,
    checked_tool_constraint,
    deadline_at,
    relabeled,
    requested_structured_outputs,
)
from conveyor.server.context import ServingContext
from conveyor.server.errors import APIError
from conveyor.server.harmony import STOP_MARKERS
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.reasoning import (
    HARMONY,
    ReasoningParser,
    ReasoningStream,
    constraint_refusal,
)
from conveyor.server.request_fields import template_fields
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
from conveyor.server.tool_parsers import ToolCall
from conveyor.server.tools import ToolCallStream, ToolSetup, tool_call_dict, tool_setup


@dataclass(slots=True)
class ChatPlan:
    """A checked chat request, ready for the engine (`prepare_chat`).

    param: the request field its output constraint came from (for the engine's rejections).
    top: how many top logprobs per token (None: no logprobs).
    """

    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolSetup | None
    reasoning: ReasoningParser | None
    param: str | None
    top: int | None


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest) -> Response:
    """Validate, render the chat template, queue the request, answer as JSON or as SSE.

    Raises:
        APIError / ValueError: a bad request (nothing is queued then).
    """
    plan = await prepare_chat(ctx, req)
    prompt_ids, params, tools, reasoning, top = (
        plan.prompt_ids, plan.params, plan.tools, plan.reasoning, plan.top
    )  # fmt: skip
    ctx.admit(params.n)
    request_id = random_id("chatcmpl")
    stream = relabeled(
        ctx.engine.generate(
            prompt_ids, params, request_id, arrival_time=request_arrival(), tenant=current_client()
        ),
        plan.param,
    )
    if req.stream:
        include_usage, continuous_usage = usage_flags(req.stream_options)
        events = _stream(
            ctx,
            request_id,
            stream,
            params.n,
            top,
            len(prompt_ids),
            include_usage,
            continuous_usage,
            tools,
            reasoning,
        )
        return sse_response(events)

    final = await whole_output(stream)
    choices = []
    for c in final.outputs:
        thinking, text = None, c.text
        if reasoning is not None:  # tool calls are read from the answer after its thinking
            thinking, text = reasoning.split(text)
            thinking = thinking or None
        content, calls, finish_reason = text, [], c.finish_reason
        if tools is not None:  # harmony's (markup) reads its channels from the whole answer
            content, calls, finish_reason = tools.read(
                c.text if tools.markup else text, c.finish_reason
            )
        if thinking is not None and not content:
            content = None
        message = ChatResponseMessage(
            content=content, tool_calls=calls, reasoning_content=thinking, reasoning=thinking
        )
        choices.append(
            ChatCompletionResponseChoice(
                index=c.index,
                message=message,
                logprobs=None
                if top is None or c.logprobs is None
                else chat_logprobs(c.token_ids, c.logprobs, top),
                finish_reason=finish_reason,
                stop_reason=stop_reason(c),
            )
        )
    num_generated = sum(len(c.token_ids) for c in final.outputs)
    body = ChatCompletionResponse(
        id=request_id,
        model=ctx.model_name,
        choices=choices,
        usage=usage(len(prompt_ids), num_generated, final.num_cached_tokens),
    )
    return JSONResponse(body.model_dump())


async def whole_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A request's stream of deltas gathered into its whole output (a non-streamed answer)."""
    final: RequestOutput | None = None
    async for out in stream:
        if final is None:
            final = out
        else:
            final.add(out)
    assert final is not None  # a stream always ends with a finished output
    return final


async def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> ChatPlan:
    """Every check of a chat request, its sampling parameters, tools, output constraint and
    prompt (the chat template rendered): all but queueing it. /v1/responses maps its
    requests onto this too (server/responses_api.py).

    Raises:
        APIError / ValueError: a bad request.
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
    template = req.chat_template
    if template is None and isinstance(req.chat_template_kwargs, dict):
        nested = req.chat_template_kwargs.get("chat_template")
        template = nested if isinstance(nested, str) else None
    tool_format = ctx.tool_format(template)
    tools = tool_setup(req.tools, req.tool_choice, tool_format, req.parallel_tool_calls)
    reasoning = ctx.reasoning(req.chat_template_kwargs, template)
    if tool_format == "harmony":  # one format: its channels are always read (server/harmony.py)
        reasoning = HARMONY
    if reasoning is not None:
        _refuse_constraints(req, tools, reasoning)
    # Cheap checks of the messages before the constraint's (which may take a worker's time).
    ctx.check_message_count(len(req.messages))
    until = deadline_at(params)
    try:
        forced = await checked_tool_constraint(tools, ctx.grammars, until)
        if forced is not None:
            # A forced call ("required", a named function) writes no text, so a
            # response_format has nothing to govern there (instructor sends both); with "auto"
            # text may come, and the call grammar cannot also hold the text to a format.
            if tools.mode == "auto" and requested_structured_outputs(req)[0] is not None:
                raise APIError(
                    f'tool_choice {tools.mode!r} with this server\'s "{tool_format}" tool-call '
                    "format constrains the output itself: send no response_format or "
                    'structured_outputs with it (or tool_choice "none").',
                    param="tool_choice",
                )
            structured, param = forced, "tools"
        else:
            structured, param = await checked_structured_outputs(req, ctx.grammars, until)
    except DeadlinePassedError:  # the engine ends it at once, as any late request
        structured, param = None, None
    if structured is not None:
        params = dataclasses.replace(params, structured_outputs=structured)
    if tools is not None and tools.stop():
        params = dataclasses.replace(params, stop=[*params.stop_strings, *tools.stop()])
    if tools is not None and tools.mode == "auto" and tool_format == "mistral":
        # [TOOL_CALLS] is a special token: the parser has to see it (as vLLM does).
        params = dataclasses.replace(params, skip_special_tokens=False)
    if reasoning is HARMONY:
        params = _harmony_params(params, ctx.engine.tokenizer)
    ctx.check_size(params.n)  # before the template runs
    prompt_ids = await ctx.render_chat(
        req.messages,
        bool(req.add_generation_prompt),
        req.chat_template_kwargs,
        req.chat_template,
        req.tools,
        template_fields(req),
        tool_setup=tools,
    )
    prompt_ids = ctx.truncated(prompt_ids, req.truncate_prompt_tokens)
    ctx.check_fits(prompt_ids, params, "messages")
    return ChatPlan(prompt_ids, params, tools, reasoning, param, top)


def _harmony_params(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """A harmony answer's parameters: its markers are special tokens the reader has to see,
    and `<|return|>` and `<|call|>` end it even where generation_config does not say so (as
    vLLM adds them)."""
    out = copy.copy(params)  # the added ids do not count against the request's own
    out.skip_special_tokens = False
    stops = [tokenizer.backend.token_to_id(marker) for marker in STOP_MARKERS]
    extra = [t for t in stops if t is not None and t not in params.stop_token_ids]
    if extra and not params.ignore_eos:
        out.stop_token_ids = [*params.stop_token_ids, *extra]
    return out


def _refuse_constraints(
    req: ChatCompletionRequest, tools: ToolSetup | None, reasoning: ReasoningParser
) -> None:
    """400 for an output constraint on a request whose thinking is split off: a grammar
    would constrain the thinking too (server/reasoning.py's docstring)."""
    param = requested_structured_outputs(req)[1]
    if param is None and tools is not None and tools.mode in ("required", "named"):
        param = "tool_choice"
    elif param is None and tools is not None and tools.mode == "auto" and tools.generic:
        param = "tools"  # the generic format's text-or-call grammar
    if param is not None:
        raise APIError(constraint_refusal(reasoning, param), param=param)


def _stream(
    ctx: ServingContext,
    request_id: str,
    stream: AsyncIterator[RequestOutput],
    n: int,
    top: int | None,
    num_prompt_tokens: int,
    include_usage: bool,
    continuous_usage: bool,
    tools: ToolSetup | None = None,
    reasoning: ReasoningParser | None = None,
) -> AsyncIterator[str]:
    """The request's SSE events: every choice's role first, then its text."""
    events = partial(
        _ChatEvents, request_id, ctx.model_name, num_prompt_tokens, continuous_usage, n, top,
        tools, reasoning,
    )  # fmt: skip
    return stream_choices(events, [stream], n, include_usage)


class _ChatEvents(ChunkEvents):
    """The events of /v1/chat/completions (a `ChoiceEvents`): each choice opens with its
    role, and a last event without text has an empty delta."""

    def __init__(
        self,
        request_id: str,
        model: str,
        num_prompt_tokens: int,
        continuous_usage: bool,
        n: int,
        top: int | None,
        tools: ToolSetup | None = None,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self._chunks = ChatChunks(
            request_id, int(time.time()), model, num_prompt_tokens, continuous_usage
        )
        self._n = n
        self._top = top
        # With "auto" or "required", each choice's text goes through a ToolCallStream:
        # content as it comes until a call begins, then tool-call deltas; a named
        # function's arguments stream as they come.
        self._tools = tools
        self._opened = [False] * n
        self._streams = (
            [ToolCallStream(tools) for _ in range(n)]
            if tools is not None and tools.mode in ("auto", "required")
            else []
        )
        # With a reasoning parser each choice's text is split first: the thinking streams as
        # reasoning_content deltas, what follows </think> goes on as content (and tool calls).
        self._reasoning: list[ReasoningStream] = (
            [reasoning.stream() for _ in range(n)] if reasoning is not None else []
        )

    def openings(self) -> list[str]:
        # The first chunk of every choice carries the role, before any token is made.
        return [self._chunks.role(i) for i in range(self._n)]

    def choice(self, index: int, text: str, output: CompletionOutput, num_generated: int) -> str:
        finish = output.finish_reason
        thinking, raw = "", text
        if self._reasoning:
            thinking, text = self._reasoning[index].feed(text)
            if finish is not None:
                more_thinking, rest = self._reasoning[index].finish()
                thinking, text = thinking + more_thinking, text + rest
        if self._tools is not None and self._tools.mode == "named":
            # The name is known from the start: stream the arguments as they come, OpenAI's
            # way (the first delta carries the call's id and name).
            call: dict[str, Any] = {"function": {"arguments": text}}
            if not self._opened[index]:
                self._opened[index] = True
                call = {**tool_call_dict(ToolCall(str(self._tools.named), text))}
            return self._chunks.tool_calls(index, None, [call], finish, num_generated)
        if self._streams:
            stream = self._streams[index]
            text, calls = stream.feed(raw if self._tools.markup else text)
            if finish is not None:
                rest, more, finish = stream.finish(finish)
                text, calls = text + rest, calls + more
            if calls:
                return self._chunks.tool_calls(
                    index, text or None, calls, finish, num_generated, thinking or None
                )
            if not text and not thinking and finish is None:
                return ""  # held back: it may be the start of a call
        logprobs = None
        if self._top is not None and output.logprobs is not None:
            logprobs = chat_logprobs(output.token_ids, output.logprobs, self._top)
        if self._reasoning:
            # Content only once the answer has some: the thinking's chunks carry none.
            content = text or None
            if not (content or thinking or finish or logprobs):
                return ""  # held back: the start of a tag, not yet known
        else:
            # OpenAI's last chunk has an empty delta unless it still carries text.
            content = text if text or finish is None else None
        return self._chunks.choice(
            index, content, logprobs, finish, stop_reason(output), num_generated, thinking or None
        )


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

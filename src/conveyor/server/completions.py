"""POST /v1/completions: one engine request per prompt, choices indexed prompt * n + sample."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from functools import partial

from fastapi.responses import JSONResponse, Response

from conveyor.engine.outputs import CompletionOutput, Logprob, RequestOutput
from conveyor.server.choice_stream import ChunkEvents, stream_choices, usage_flags
from conveyor.server.clients import current_client, request_arrival
from conveyor.server.constraints import (
    DeadlinePassedError,
    checked_structured_outputs,
    deadline_at,
    relabeled,
)
from conveyor.server.context import ServingContext
from conveyor.server.errors import APIError
from conveyor.server.offload import INLINE_TOKENS, maybe_off_loop
from conveyor.server.protocol import CompletionRequest
from conveyor.server.responses import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    random_id,
    stop_reason,
    usage,
)
from conveyor.server.sse import CompletionChunks
from conveyor.server.streaming import merge_streams, sse_response


async def create_completion(ctx: ServingContext, req: CompletionRequest) -> Response:
    """Validate everything, queue one request per prompt, answer as JSON or as SSE.

    Raises:
        APIError / ValueError: a bad request (nothing is queued then).
    """
    ctx.check_model(req.model)
    req.check_common()
    if req.suffix:
        raise APIError("suffix is not supported by this server.", param="suffix")
    params = ctx.with_timeout(req.sampling_params(req.max_tokens, req.logprobs))
    echo_logprobs = bool(req.echo) and req.logprobs is not None
    if echo_logprobs:  # the prompt's tokens lead the logprobs, computed with the prompt
        num = max(params.prompt_logprobs or 0, req.logprobs)
        params = dataclasses.replace(params, prompt_logprobs=num)
    if req.stream and params.prompt_logprobs is not None:
        raise APIError(
            "Prompt logprobs (prompt_logprobs, or echo with logprobs) are not streamed: "
            "send them with stream false.",
            param="prompt_logprobs" if req.prompt_logprobs is not None else "echo",
        )
    until = deadline_at(params)
    try:
        structured, param = await checked_structured_outputs(req, ctx.grammars, until)
    except DeadlinePassedError:  # the engine ends it at once, as any late request
        structured, param = None, None
    if structured is not None:
        params = dataclasses.replace(params, structured_outputs=structured)
    engine = ctx.engine
    prompts = req.prompts()
    ctx.check_size(params.n, len(prompts))  # before any prompt is tokenized
    special = req.add_special_tokens is not False
    prompt_ids = [await ctx.tokenize_prompt(p, special) for p in prompts]
    whole = [len(ids) for ids in prompt_ids]
    prompt_ids = [ctx.truncated(ids, req.truncate_prompt_tokens) for ids in prompt_ids]
    for ids in prompt_ids:  # every prompt is checked before any is queued
        ctx.check_fits(ids, params, "prompt")
    echo_texts = None
    if req.echo:
        decode = engine.tokenizer.decode
        # A truncated prompt echoes what the model saw: its kept tokens, decoded.
        echo_texts = [
            p
            if isinstance(p, str) and len(ids) == n
            else await maybe_off_loop(len(ids), INLINE_TOKENS, decode, ids)
            for p, ids, n in zip(prompts, prompt_ids, whole, strict=True)
        ]
    ctx.admit(params.n, len(prompts))
    request_id = random_id("cmpl")
    streams = [
        relabeled(
            engine.generate(
                p,
                params,
                f"{request_id}-{i}",
                prompt_token_ids=ids,
                arrival_time=request_arrival(),
                tenant=current_client(),
            ),
            param,
        )
        for i, (p, ids) in enumerate(zip(prompts, prompt_ids, strict=True))
    ]
    num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
    if req.stream:
        include_usage, continuous_usage = usage_flags(req.stream_options)
        events = _stream(
            ctx,
            request_id,
            streams,
            params.n,
            req.logprobs,
            echo_texts,
            num_prompt_tokens,
            include_usage,
            continuous_usage,
        )
        return sse_response(events)

    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        if finals[i] is None:
            finals[i] = out
        else:
            finals[i].add(out)  # type: ignore[union-attr]
    choices = []
    num_generated = 0
    for i, final in enumerate(finals):
        assert final is not None  # every stream ends with a finished output
        for c in final.outputs:
            num_generated += len(c.token_ids)
            text = c.text if echo_texts is None else echo_texts[i] + c.text
            logprobs, offset = None, 0
            if echo_logprobs and final.prompt_logprobs is not None:
                first = engine.tokenizer.id_to_token_text(prompt_ids[i][0])
                logprobs, offset = echoed_logprobs(
                    prompt_ids[i], final.prompt_logprobs, first, req.logprobs
                )
            if req.logprobs is not None and c.logprobs is not None:
                generated = completion_logprobs(c.token_ids, c.logprobs, req.logprobs, offset)[0]
                logprobs = generated if logprobs is None else logprobs.extended(generated)
            choices.append(
                CompletionResponseChoice(
                    index=i * params.n + c.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=stop_reason(c),
                    prompt_logprobs=None
                    if req.prompt_logprobs is None
                    else vllm_prompt_logprobs(final.prompt_logprobs),
                )
            )
    body = CompletionResponse(
        id=request_id,
        model=ctx.model_name,
        choices=choices,
        usage=usage(
            num_prompt_tokens, num_generated, sum(f.num_cached_tokens for f in finals if f)
        ),
    )
    return JSONResponse(body.model_dump())


def _stream(
    ctx: ServingContext,
    request_id: str,
    streams: list[AsyncIterator[RequestOutput]],
    n: int,
    num_logprobs: int | None,
    echo_texts: list[str] | None,
    num_prompt_tokens: int,
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncIterator[str]:
    """The request's SSE events; choice `i * n + k` is sample k of prompt i."""
    events = partial(
        _CompletionEvents,
        request_id,
        ctx.model_name,
        num_prompt_tokens,
        continuous_usage,
        len(streams) * n,
        num_logprobs,
    )
    return stream_choices(events, streams, n, include_usage, echo_texts)


class _CompletionEvents(ChunkEvents):
    """The events of /v1/completions (a `ChoiceEvents`): text as it comes, logprobs whose
    text offsets run on over a choice's events."""

    def __init__(
        self,
        request_id: str,
        model: str,
        num_prompt_tokens: int,
        continuous_usage: bool,
        num_choices: int,
        num_logprobs: int | None,
    ) -> None:
        self._chunks = CompletionChunks(
            request_id, int(time.time()), model, num_prompt_tokens, continuous_usage
        )
        self._num_logprobs = num_logprobs
        self._offsets = [0] * num_choices  # text_offset of the next token, per choice

    def openings(self) -> tuple[str, ...]:
        return ()

    def choice(self, index: int, text: str, output: CompletionOutput, num_generated: int) -> str:
        logprobs = None
        if self._num_logprobs is not None and output.logprobs is not None:
            logprobs, self._offsets[index] = completion_logprobs(
                output.token_ids, output.logprobs, self._num_logprobs, self._offsets[index]
            )
        return self._chunks.choice(
            index, text, logprobs, output.finish_reason, stop_reason(output), num_generated
        )


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], num: int, offset: int
) -> tuple[CompletionLogProbs, int]:
    """The legacy completions logprobs object, as vLLM builds it.

    Args:
        token_ids: sampled tokens; entries[k] holds token_ids[k] and the top alternatives.
        num: the request's `logprobs`; each position lists up to num + 1 tokens (the sampled
            one first, then the top `num`).
        offset: text offset of the first token.
    Returns:
        The object and the text offset after its last token.
    """
    out = CompletionLogProbs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        out.tokens.append(token)
        out.token_logprobs.append(max(sampled.logprob, -9999.0))
        out.top_logprobs.append(
            {
                (lp.decoded_token or ""): max(lp.logprob, -9999.0)
                for k, lp in enumerate(entry.values())
                if k <= num
            }
        )
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset


def echoed_logprobs(
    prompt_ids: list[int], entries: list[dict[int, Logprob] | None], first: str, num: int
) -> tuple[CompletionLogProbs, int]:
    """The prompt's part of an echoed choice's logprobs: its first token has none (as in
    OpenAI and vLLM), the others their prompt logprobs. Returns it and the text offset after."""
    out = CompletionLogProbs(
        text_offset=[0], token_logprobs=[None], tokens=[first], top_logprobs=[None]
    )
    rest, offset = completion_logprobs(prompt_ids[1:], entries[1:], num, len(first))  # type: ignore[arg-type]
    return out.extended(rest), offset


def vllm_prompt_logprobs(
    entries: list[dict[int, Logprob] | None] | None,
) -> list[dict[str, dict[str, object]] | None] | None:
    """vLLM's `prompt_logprobs` of a choice: token id -> logprob, rank, decoded token."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank,
                     "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]  # fmt: skip

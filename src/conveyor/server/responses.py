"""Pydantic models of what the server answers: responses, stream chunks, models, tokenize.

Shapes follow OpenAI and vLLM (vLLM's `stop_reason` extension included: the stop string or
token id that ended a choice, or, for finish_reason "abort", why the engine aborted it, e.g.
"deadline exceeded: ..."; None for a client's abort). Stream chunks are
serialized with `exclude_unset=True`, as vLLM does: a chat delta carries `role` only in the
first chunk of a choice, and `usage` only where it was set; logprobs objects are always
sent whole (`_Whole`). server/sse.py writes the common
stream chunks without building these models, byte for byte as they would serialize: a change
to a chunk model needs the same change there (tests/server/test_sse_encoding.py compares the two).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from conveyor.engine.outputs import CompletionOutput


def stop_reason(c: CompletionOutput) -> int | str | None:
    """vLLM's `stop_reason` of a choice; an aborted choice says why it was aborted."""
    if c.finish_reason == "abort" and c.abort_reason:
        return c.abort_reason
    return c.stop_reason


def random_id(prefix: str) -> str:
    """An id like `cmpl-3f2a...` (32 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache already held


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class _Whole(BaseModel):
    """A model every field of which is always sent, even inside a stream chunk dumped with
    `exclude_unset`: logprobs objects are built by appending to their default lists, which
    pydantic does not count as setting them (a streamed `"logprobs": {}` otherwise)."""

    def model_post_init(self, context: object, /) -> None:
        self.model_fields_set.update(type(self).model_fields)


# ---------------------------------------------------------------- completions
class CompletionLogProbs(_Whole):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)

    def extended(self, more: CompletionLogProbs) -> CompletionLogProbs:
        """These positions followed by `more`'s."""
        return CompletionLogProbs(
            text_offset=self.text_offset + more.text_offset,
            token_logprobs=self.token_logprobs + more.token_logprobs,
            tokens=self.tokens + more.tokens,
            top_logprobs=self.top_logprobs + more.top_logprobs,
        )


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: per prompt token (None for the first), token id -> logprob, rank, decoded_token.
    prompt_logprobs: list[dict[str, dict[str, object]] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class _StreamChunk(BaseModel):
    """Stream chunks are dumped with exclude_unset; `object` counts as set though defaulted."""

    def model_post_init(self, context: object, /) -> None:
        self.model_fields_set.add("object")


class CompletionStreamResponse(_StreamChunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- chat
class ChatLogProb(_Whole):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(_Whole):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, object]] = Field(default_factory=list)
    # The answer's thinking (server/reasoning.py), under vLLM's older name and its newer one.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, object]] | None = None
    reasoning_content: str | None = None  # sent (with `reasoning`) only while it thinks
    reasoning: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_StreamChunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- other endpoints
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "conveyor"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str

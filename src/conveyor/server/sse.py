"""Fast SSE events for streamed completions and chat completions, byte-identical to `sse()`.

Building the pydantic chunk models and dumping them with `exclude_unset=True` cost about ten
times as much per streamed token as this module (docs/kernels.md#measured-choices), on the
event-loop thread every stream shares. Here a request's constant head (`data: {"id":…,
"object":…,"created":…,"model":…,"choices":[`) is rendered once, by pydantic itself, and each
event only encodes its choice with `json`: strings the way pydantic writes them (no spaces,
non-ASCII kept, the same escapes), ints, null.

Anything else goes through the models and `sse()`: a choice with logprobs (pydantic writes
floats its own way: 1e-05 as 0.00001, inf as null) or a value of another type than the
engine gives (pydantic validates it). tests/server/test_sse_encoding.py checks both paths agree.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import BaseModel

from conveyor.server.responses import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProbs,
    CompletionLogProbs,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    usage,
)
from conveyor.server.streaming import sse

# A str as pydantic serializes it: a JSON string without escaping non-ASCII.
_string = json.JSONEncoder(ensure_ascii=False).encode

_CHOICES_END = "]}\n\n"  # what follows the choices of an event without usage


def _scalar(value: int | str | None) -> str:
    """JSON of a `str | int | None` field; `_plain` has checked its type."""
    if value is None:
        return "null"
    if type(value) is int:
        return str(value)
    return _string(value)


def _plain(text: object, finish_reason: object, stop_reason: object) -> bool:
    """Whether these have the engine's types (text a str, finish_reason a str or None,
    stop_reason an int, a str or None), the only ones the fast path encodes: a bool, say,
    pydantic would write as an int, and other types it would validate or refuse."""
    return (
        type(text) is str
        and (finish_reason is None or type(finish_reason) is str)
        and (stop_reason is None or type(stop_reason) is str or type(stop_reason) is int)
    )


class _Chunks:
    """The events of one streamed request, in the shape of `chunk_type`."""

    chunk_type: ClassVar[type[CompletionStreamResponse | ChatCompletionStreamResponse]]

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        num_prompt_tokens: int,
        continuous_usage: bool,
    ) -> None:
        """Render the head every event of the request starts with, once.

        Args:
            num_prompt_tokens: the prompt tokens `usage` counts.
            continuous_usage: every choice event carries `usage` (stream_options'
                continuous_usage_stats), not only the last event.
        """
        self._fields = {"id": request_id, "created": created, "model": model}
        self._num_prompt_tokens = num_prompt_tokens
        self._continuous_usage = continuous_usage
        # Prompt tokens the prefix cache held, as known so far (the engine reports it with
        # a request's first output); `usage` reports it.
        self.num_cached_tokens = 0
        empty = sse(self.chunk_type(**self._fields, choices=[]))
        assert empty.endswith(_CHOICES_END)  # `choices` is the last field that is set
        self._head = empty[: -len(_CHOICES_END)]

    def usage(self, num_generated: int) -> str:
        """The last event of a stream that includes usage: no choices, only the counts."""
        return self._event("", True, num_generated)

    def _event(self, choice: str, with_usage: bool, num_generated: int) -> str:
        """The event around one encoded choice (or none); `usage` follows when asked for."""
        if not with_usage:
            return self._head + choice + _CHOICES_END
        p = self._num_prompt_tokens
        counts = (
            f'{{"prompt_tokens":{p},"total_tokens":{p + num_generated},'
            f'"completion_tokens":{num_generated},'
            f'"prompt_tokens_details":{{"cached_tokens":{self.num_cached_tokens}}}}}'
        )
        return f'{self._head}{choice}],"usage":{counts}}}\n\n'

    def _choice_event(self, choice: str, num_generated: int) -> str:
        return self._event(choice, self._continuous_usage, num_generated)

    def _model_event(self, choice: BaseModel, num_generated: int) -> str:
        """The slow path: the chunk as a model, through `sse()`."""
        chunk = self.chunk_type(**self._fields, choices=[choice])
        if self._continuous_usage:
            chunk.usage = usage(self._num_prompt_tokens, num_generated, self.num_cached_tokens)
        return sse(chunk)


class CompletionChunks(_Chunks):
    """Events of /v1/completions: `CompletionStreamResponse` with one choice each."""

    chunk_type = CompletionStreamResponse

    def choice(
        self,
        index: int,
        text: str,
        logprobs: CompletionLogProbs | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        num_generated: int,
    ) -> str:
        """The event of one choice's new text; `num_generated` feeds continuous usage."""
        if logprobs is not None or not _plain(text, finish_reason, stop_reason):
            choice = CompletionResponseChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
            return self._model_event(choice, num_generated)
        encoded = (
            f'{{"index":{index},"text":{_string(text)},"logprobs":null,'
            f'"finish_reason":{_scalar(finish_reason)},"stop_reason":{_scalar(stop_reason)}}}'
        )
        return self._choice_event(encoded, num_generated)


class ChatChunks(_Chunks):
    """Events of /v1/chat/completions: `ChatCompletionStreamResponse` with one choice each."""

    chunk_type = ChatCompletionStreamResponse

    def role(self, index: int) -> str:
        """The first event of a choice: its role and empty content, before any token."""
        encoded = (
            f'{{"index":{index},"delta":{{"role":"assistant","content":""}},'
            '"logprobs":null,"finish_reason":null}'
        )
        return self._choice_event(encoded, 0)

    def tool_calls(
        self,
        index: int,
        content: str | None,
        calls: list[dict[str, Any]],
        finish_reason: str | None,
        num_generated: int,
        reasoning: str | None = None,
    ) -> str:
        """An event carrying tool-call deltas (each with its `index`: its own, or its place),
        and the end of the thinking before them if this output holds it."""
        deltas = [c if "index" in c else {"index": i, **c} for i, c in enumerate(calls)]
        delta = DeltaMessage(content=content, tool_calls=deltas)
        if reasoning is not None:
            delta.reasoning_content = delta.reasoning = reasoning
        choice = ChatCompletionStreamChoice(index=index, delta=delta, finish_reason=finish_reason)
        return self._model_event(choice, num_generated)

    def choice(
        self,
        index: int,
        content: str | None,
        logprobs: ChatLogProbs | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        num_generated: int,
        reasoning: str | None = None,
    ) -> str:
        """The event of one choice's new text.

        Args:
            content: None sends an empty delta (a last event without text).
            stop_reason: sent only together with a finish_reason, as vLLM does.
            reasoning: new thinking (server/reasoning.py), sent as `reasoning_content` and
                `reasoning`; None sends neither.
        """
        plain = _plain("" if content is None else content, finish_reason, stop_reason)
        plain = plain and (reasoning is None or type(reasoning) is str)
        if logprobs is not None or not plain:
            delta = DeltaMessage() if content is None else DeltaMessage(content=content)
            if reasoning is not None:
                delta.reasoning_content = delta.reasoning = reasoning
            choice = ChatCompletionStreamChoice(
                index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
            )
            if finish_reason is not None:
                choice.stop_reason = stop_reason
            return self._model_event(choice, num_generated)
        fields = [] if content is None else [f'"content":{_string(content)}']
        if reasoning is not None:
            thought = _string(reasoning)
            fields += [f'"reasoning_content":{thought}', f'"reasoning":{thought}']
        delta = "{" + ",".join(fields) + "}"
        encoded = f'{{"index":{index},"delta":{delta},"logprobs":null,"finish_reason":'
        if finish_reason is None:
            encoded += "null}"
        else:
            encoded += f'{_string(finish_reason)},"stop_reason":{_scalar(stop_reason)}}}'
        return self._choice_event(encoded, num_generated)

"""The one streaming path of /v1/completions and /v1/chat/completions.

Both send one event per choice's new output, skip what the engine holds back, ignore a
finished choice's later outputs, count generated tokens for usage and end with a usage event
when asked. What differs between the endpoints (the chunk encoder, the events that open the
stream, how a choice's text and logprobs are sent) is the `ChoiceEvents` each passes in.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.server.protocol import StreamOptions
from conveyor.server.streaming import merge_streams

if TYPE_CHECKING:
    from conveyor.server.sse import _Chunks


class ChoiceEvents(Protocol):
    """An endpoint's SSE events for one streamed request."""

    def openings(self) -> Iterable[str]:
        """The events sent before any engine output."""

    def choice(self, index: int, text: str, output: CompletionOutput, num_generated: int) -> str:
        """The event of one choice's new output.

        Args:
            index: the choice's index in the response.
            text: the output's new text (after the echoed prompt, on a choice's first event).
            output: the engine's output for the choice (token ids, logprobs, finish reason).
            num_generated: tokens generated so far over all choices, this output's included.
        """

    def usage(self, num_generated: int) -> str:
        """The last event of a stream that includes usage."""

    def set_cached_tokens(self, num_cached: int) -> None:
        """Prompt tokens the prefix cache held, over all prompts (for the usage it sends)."""


class ChunkEvents:
    """What both endpoints' `ChoiceEvents` do alike: the usage event and the cached-token
    count belong to their chunk encoder (`self._chunks`, a conveyor.server.sse chunk class
    the subclass builds)."""

    _chunks: _Chunks

    def usage(self, num_generated: int) -> str:
        return self._chunks.usage(num_generated)

    def set_cached_tokens(self, num_cached: int) -> None:
        self._chunks.num_cached_tokens = num_cached


def usage_flags(opts: StreamOptions | None) -> tuple[bool, bool]:
    """(include_usage, continuous_usage): whether a stream ends with usage, and whether every
    choice event carries it too (only with include_usage, as in vLLM)."""
    if opts is None or not opts.include_usage:
        return False, False
    return True, bool(opts.continuous_usage_stats)


async def stream_choices(
    new_events: Callable[[], ChoiceEvents],
    streams: list[AsyncIterator[RequestOutput]],
    n: int,
    include_usage: bool,
    echo_texts: list[str] | None = None,
) -> AsyncIterator[str]:
    """The SSE events of a streamed request; choice `i * n + k` is sample k of stream i.

    Args:
        new_events: builds the endpoint's events when the stream starts (so `created` is
            the time of the first event, not of the request's arrival).
        streams: one engine stream per prompt, each with `n` samples.
        include_usage: end with a usage event.
        echo_texts: per stream, the text sent before the first output of each of its choices
            (completions' `echo`); None sends none.
    Returns:
        The events, without the SSE framing's error and [DONE] events (`sse_response`).
    """
    events = new_events()
    for event in events.openings():
        yield event
    num_choices = len(streams) * n
    echoed = [echo_texts is None] * num_choices
    finished = [False] * num_choices
    num_generated = 0
    cached = [0] * len(streams)
    async for i, out in merge_streams(streams):
        if out.num_cached_tokens != cached[i]:
            cached[i] = out.num_cached_tokens
            events.set_cached_tokens(sum(cached))
        for c in out.outputs:
            index = i * n + c.index
            if finished[index]:
                continue
            text = c.text
            if not echoed[index]:
                text = echo_texts[i] + text  # type: ignore[index]
                echoed[index] = True
            finished[index] = c.finish_reason is not None
            if not (text or c.token_ids or finished[index]):
                continue  # held-back text (a possible stop string): nothing to send yet
            num_generated += len(c.token_ids)
            yield events.choice(index, text, c, num_generated)
    if include_usage:
        yield events.usage(num_generated)

"""The fast stream events of server/sse.py are byte for byte what pydantic's `sse(chunk)` sends.

Each reference below builds the chunk models the way the endpoints did before the fast path
(every field passed explicitly, `stop_reason` of a chat choice set only with a finish_reason,
`usage` assigned only when asked for) and dumps them with `sse()`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.server import chat, completions
from conveyor.server.responses import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    CompletionLogProbs,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    random_id,
    usage,
)
from conveyor.server.sse import ChatChunks, CompletionChunks
from conveyor.server.streaming import sse, sse_response

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
CREATED = 1_700_000_000
SPECIAL_TEXTS = [
    "",
    " world",
    'say "hi"',
    "back\\slash \\u0041 \\n",
    "\x00\x01\x08\x0b\x1f\x7f\x80\x9f",
    "\n\r\t\b\f",
    "\u2028\u2029 line separators",
    "</script><!-- & ' >",
    "😀👩‍👩‍👧 🇫🇷",
    "中文 日本語 한국어",
    "é ß Ω \ufeff \ufffd \U0010ffff",
]
# Every code point a Python str from the detokenizer can hold (lone surrogates cannot).
ALL_CODE_POINTS = "".join(chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c < 0xE000)
FLOATS = [0.0, -0.0, -9999.0, -1e-05, 1e-05, -0.1, -123.456, -1e20, float("-inf"), float("nan")]

texts = st.one_of(st.sampled_from(SPECIAL_TEXTS), st.text())
finish_reasons = st.sampled_from([None, "stop", "length", "abort"])
stop_reasons = st.one_of(
    st.none(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.booleans(),
    st.sampled_from(["</s>", "deadline exceeded: 2.0 s", "\n\n"]),
    st.text(),
)
counts = st.integers(min_value=0, max_value=10**7)
indices = st.integers(min_value=0, max_value=1000)
continuous = st.booleans()
headers = st.tuples(
    st.sampled_from(["cmpl", "chatcmpl"]).map(random_id),
    st.integers(min_value=0, max_value=2**40),
    st.one_of(st.just(MODEL), st.text(min_size=1)),
)
logprob_values = st.one_of(st.sampled_from(FLOATS), st.floats())


@st.composite
def completion_logprobs(draw: st.DrawFn) -> CompletionLogProbs | None:
    if draw(st.booleans()):
        return None
    tokens = draw(st.lists(texts, max_size=3))
    return CompletionLogProbs(
        text_offset=list(range(len(tokens))),
        token_logprobs=[draw(logprob_values) for _ in tokens],
        tokens=tokens,
        top_logprobs=[{t: draw(logprob_values)} for t in tokens],
    )


@st.composite
def chat_logprobs(draw: st.DrawFn) -> ChatLogProbs | None:
    if draw(st.booleans()):
        return None
    tokens = draw(st.lists(texts, max_size=3))
    return ChatLogProbs(
        content=[
            ChatLogProbsContent(
                token=t,
                logprob=draw(logprob_values),
                bytes=list(t.encode()),
                top_logprobs=[ChatLogProb(token=t, logprob=draw(logprob_values))],
            )
            for t in tokens
        ]
    )


def _with_usage(chunk, prompt: int, generated: int, continuous_usage: bool) -> str:
    if continuous_usage:
        chunk.usage = usage(prompt, generated)
    return sse(chunk)


def completion_reference(
    header, prompt, continuous_usage, index, text, logprobs, finish, stop, generated
) -> str:
    request_id, created, model = header
    choice = CompletionResponseChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=finish, stop_reason=stop
    )
    chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])
    return _with_usage(chunk, prompt, generated, continuous_usage)


def chat_reference(
    header, prompt, continuous_usage, index, content, logprobs, finish, stop, generated
) -> str:
    request_id, created, model = header
    delta = DeltaMessage() if content is None else DeltaMessage(content=content)
    choice = ChatCompletionStreamChoice(
        index=index, delta=delta, logprobs=logprobs, finish_reason=finish
    )
    if finish is not None:
        choice.stop_reason = stop
    chunk = ChatCompletionStreamResponse(
        id=request_id, created=created, model=model, choices=[choice]
    )
    return _with_usage(chunk, prompt, generated, continuous_usage)


def role_reference(header, prompt, continuous_usage, index) -> str:
    request_id, created, model = header
    choice = ChatCompletionStreamChoice(
        index=index,
        delta=DeltaMessage(role="assistant", content=""),
        logprobs=None,
        finish_reason=None,
    )
    chunk = ChatCompletionStreamResponse(
        id=request_id, created=created, model=model, choices=[choice]
    )
    return _with_usage(chunk, prompt, 0, continuous_usage)


def usage_reference(chunk_type, header, prompt, generated) -> str:
    request_id, created, model = header
    return sse(
        chunk_type(
            id=request_id,
            created=created,
            model=model,
            choices=[],
            usage=usage(prompt, generated),
        )
    )


@settings(max_examples=200)
@given(
    headers,
    counts,
    continuous,
    indices,
    texts,
    completion_logprobs(),
    finish_reasons,
    stop_reasons,
    counts,
)
def test_completion_event_matches_pydantic(
    header, prompt, continuous_usage, index, text, logprobs, finish, stop, generated
) -> None:
    chunks = CompletionChunks(*header, prompt, continuous_usage)
    event = (index, text, logprobs, finish, stop, generated)
    expected = completion_reference(header, prompt, continuous_usage, *event)
    assert chunks.choice(*event) == expected


@settings(max_examples=200)
@given(
    headers,
    counts,
    continuous,
    indices,
    st.one_of(st.none(), texts),
    chat_logprobs(),
    finish_reasons,
    stop_reasons,
    counts,
)
def test_chat_event_matches_pydantic(
    header, prompt, continuous_usage, index, content, logprobs, finish, stop, generated
) -> None:
    chunks = ChatChunks(*header, prompt, continuous_usage)
    event = (index, content, logprobs, finish, stop, generated)
    assert chunks.choice(*event) == chat_reference(header, prompt, continuous_usage, *event)


@given(headers, counts, continuous, indices)
def test_chat_role_event_matches_pydantic(header, prompt, continuous_usage, index) -> None:
    chunks = ChatChunks(*header, prompt, continuous_usage)
    expected = role_reference(header, prompt, continuous_usage, index)
    assert chunks.role(index) == expected


@given(headers, counts, continuous, counts)
def test_usage_event_matches_pydantic(header, prompt, continuous_usage, generated) -> None:
    for encoder, chunk_type in [
        (CompletionChunks, CompletionStreamResponse),
        (ChatChunks, ChatCompletionStreamResponse),
    ]:
        chunks = encoder(*header, prompt, continuous_usage)
        expected = usage_reference(chunk_type, header, prompt, generated)
        assert chunks.usage(generated) == expected


@pytest.mark.parametrize("text", SPECIAL_TEXTS)
def test_fixed_cases_of_both_endpoints(text) -> None:
    header = (random_id("cmpl"), CREATED, MODEL)
    cases = itertools.product(
        [None, "stop", "length", "abort"], [None, 0, 151645, "</s>", 'a "quoted"\nstop'], [0, 3]
    )
    for finish, stop, index in cases:
        for continuous_usage in (False, True):
            event = (index, text, None, finish, stop, 7)
            completion = CompletionChunks(*header, 11, continuous_usage).choice(*event)
            assert completion == completion_reference(header, 11, continuous_usage, *event)
            chunk = ChatChunks(*header, 11, continuous_usage).choice(*event)
            assert chunk == chat_reference(header, 11, continuous_usage, *event)
        assert json.loads(completion[len("data: ") :])["choices"][0]["text"] == text


def test_every_code_point_is_escaped_as_pydantic_does() -> None:
    header = (random_id("cmpl"), CREATED, MODEL)
    event = (0, ALL_CODE_POINTS, None, None, None, 1)
    completion = CompletionChunks(*header, 1, False).choice(*event)
    assert completion == completion_reference(header, 1, False, *event)
    chunk = ChatChunks(*header, 1, False).choice(*event)
    assert chunk == chat_reference(header, 1, False, *event)


def test_the_fast_path_leaves_out_unset_keys() -> None:
    """What exclude_unset means on the wire: no `usage` key unless asked for, a chat choice's
    `stop_reason` only with its finish_reason, `role` only in the first event."""
    chunks = ChatChunks("chatcmpl-1", CREATED, MODEL, 5, continuous_usage=False)
    first = json.loads(chunks.role(0)[len("data: ") :])
    assert "usage" not in first and first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    middle = json.loads(chunks.choice(0, "Hi", None, None, None, 1)[len("data: ") :])
    assert middle["choices"][0] == {
        "index": 0,
        "delta": {"content": "Hi"},
        "logprobs": None,
        "finish_reason": None,
    }
    last = json.loads(chunks.choice(0, None, None, "stop", 2, 2)[len("data: ") :])
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["stop_reason"] == 2


def test_an_unencodable_event_ends_the_stream_with_an_error_event() -> None:
    """json lets a lone surrogate through where pydantic refused it: the stream still ends
    with one error event and [DONE] instead of breaking."""
    chunks = CompletionChunks("cmpl-1", CREATED, MODEL, 1, continuous_usage=False)

    async def events() -> AsyncIterator[str]:
        yield chunks.choice(0, "fine", None, None, None, 1)
        yield chunks.choice(0, "\ud800", None, None, None, 2)

    async def body() -> list[bytes]:
        return [event async for event in sse_response(events()).body_iterator]

    sent = asyncio.run(body())
    assert sent[0] == chunks.choice(0, "fine", None, None, None, 1).encode()
    assert json.loads(sent[1][len(b"data: ") :])["error"]["code"] == 400
    assert sent[2:] == [b"data: [DONE]\n\n"]


def _output(index, text, tokens, finish=None, stop=None) -> CompletionOutput:
    return CompletionOutput(index, text, tokens, finish_reason=finish, stop_reason=stop)


async def _stream_of(*outputs: list[CompletionOutput]) -> AsyncIterator[RequestOutput]:
    for out in outputs:
        yield RequestOutput("r", None, [1, 2], outputs=out)


def _collect(events: AsyncIterator[str]) -> list[str]:
    async def run() -> list[str]:
        return [event async for event in events]

    return asyncio.run(run())


def _created(event: str) -> int:
    return json.loads(event[len("data: ") :])["created"]


def test_completion_stream_sends_the_reference_events() -> None:
    """The endpoint's stream wires outputs to events as before: echo, held-back text skipped,
    a finished choice's later outputs ignored, usage with every event and at the end."""
    ctx = SimpleNamespace(model_name=MODEL)
    streams = [
        _stream_of(
            [_output(0, "Hello", [5]), _output(1, "", [])],
            [_output(0, " you", [6], "stop", "</s>"), _output(1, "Yo", [7, 8], "length")],
            [_output(0, "late", [9])],
        )
    ]
    events = _collect(
        completions._stream(ctx, "cmpl-x", streams, 2, None, ["Echo: "], 2, True, True)
    )
    header = ("cmpl-x", _created(events[0]), MODEL)
    assert events == [
        completion_reference(header, 2, True, 0, "Echo: Hello", None, None, None, 1),
        completion_reference(header, 2, True, 1, "Echo: ", None, None, None, 1),
        completion_reference(header, 2, True, 0, " you", None, "stop", "</s>", 2),
        completion_reference(header, 2, True, 1, "Yo", None, "length", None, 4),
        usage_reference(CompletionStreamResponse, header, 2, 4),
    ]


def test_chat_stream_sends_the_reference_events() -> None:
    """Role events first, then text; a last output without text sends an empty delta."""
    ctx = SimpleNamespace(model_name=MODEL)
    stream = _stream_of(
        [_output(0, "Hi", [5]), _output(1, "", [])],
        [_output(0, "", [], "stop", 7), _output(1, "Yo", [6], "abort", "deadline exceeded")],
    )
    events = _collect(chat._stream(ctx, "chatcmpl-x", stream, 2, None, 3, True, True))
    header = ("chatcmpl-x", _created(events[0]), MODEL)
    assert events == [
        role_reference(header, 3, True, 0),
        role_reference(header, 3, True, 1),
        chat_reference(header, 3, True, 0, "Hi", None, None, None, 1),
        chat_reference(header, 3, True, 0, None, None, "stop", 7, 1),
        chat_reference(header, 3, True, 1, "Yo", None, "abort", "deadline exceeded", 2),
        usage_reference(ChatCompletionStreamResponse, header, 3, 2),
    ]
    assert abs(_created(events[0]) - time.time()) < 60

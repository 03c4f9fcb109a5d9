"""Tool-call formats on canned model text (parsed whole and streamed), the format read from
chat templates, messages as templates get them, and the tool setups that need no model."""

from __future__ import annotations

import json

import pytest

from conveyor.server.protocol import ChatMessage
from conveyor.server.tool_fallback import fallback_messages
from conveyor.server.tool_parsers import (
    ToolCall,
    detect_tool_format,
    parse_generic,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
)
from conveyor.server.tools import ToolCallStream, tool_setup
from conveyor.structured.grammar import _byte_compiler, build_grammar

QWEN_TEXT = (
    "Let me check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    "<tool_call>\n"
    '{"name": "book_room", "arguments": {"room": 12, "nights": 2}}\n</tool_call>'
)


def test_hermes_reads_qwen25_tool_calls_and_the_text_before_them() -> None:
    content, calls = parse_hermes(QWEN_TEXT)
    assert content == "Let me check both."
    assert calls == [
        ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "c"})),
        ToolCall("book_room", json.dumps({"room": 12, "nights": 2})),
    ]


def test_hermes_takes_an_unclosed_last_call_and_string_arguments() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'
    assert parse_hermes(text) == (None, [ToolCall("f", '{"x": 1}')])


@pytest.mark.parametrize(
    "text",
    ["Just an answer.", "<tool_call>{not json}</tool_call>", '<tool_call>{"args": {}}</tool_call>'],
)
def test_hermes_leaves_text_without_a_valid_call_as_content(text) -> None:
    assert parse_hermes(text) == (text, [])


def test_llama3_json_reads_one_or_several_calls() -> None:
    one = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert parse_llama3_json(one) == (None, [ToolCall("get_weather", '{"city": "Oslo"}')])
    two = '{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": [1]}}'
    assert parse_llama3_json(two) == (None, [ToolCall("a", "{}"), ToolCall("b", '{"k": [1]}')])
    for text in ("Hello", '{"name": "a", "parameters": {}} trailing', '{"nom": "a"}'):
        assert parse_llama3_json(text) == (text, [])


def test_required_builds_one_schema_over_all_tools_and_reads_its_array() -> None:
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "b"}},
    ]
    setup = tool_setup(tools, "required", "hermes")
    schema = json.loads(setup.constraint().spec)
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["a"], ["b"]]
    content, calls, finish = setup.read('[{"name":"b","parameters":{"q":1}}]', "stop")
    assert content is None and finish == "tool_calls"
    assert calls[0]["function"] == {"name": "b", "arguments": '{"q":1}'}  # as written
    # Cut off by max_tokens: a call as far as written once its name is (what a stream sent),
    # none before that.
    content, calls, finish = setup.read('[{"name":"b","param', "length")
    assert (content, finish) == (None, "length") and calls[0]["function"]["arguments"] == ""
    assert setup.read('[{"name":"b', "length") == ('[{"name":"b', [], "length")


def test_mistral_reads_the_json_array_and_the_name_args_forms() -> None:
    text = (
        'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    )
    assert parse_mistral(text) == ("Sure.", [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")])
    named = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'
    assert parse_mistral(named) == (None, [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")])
    for text in ("No calls here.", '[TOOL_CALLS][{"name": "a", "arguments": 3}]'):
        assert parse_mistral(text) == (text, [])


def test_generic_reads_only_a_whole_envelope() -> None:
    text = '{"tool_calls":[{"name":"a","arguments":{"x":[1,{"y":"}"}]}}]}'
    assert parse_generic(text) == (None, [ToolCall("a", '{"x":[1,{"y":"}"}]}')])
    for text in ("Plain text {with braces}", '{"tool_calls":[]}', '{"tool_calls":[{"name":"a"'):
        assert parse_generic(text) == (text, [])


TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "book")]
STREAMED = [
    ("hermes", 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris}", "when": {"day": 1}}}\n</tool_call>\n<tool_call>\n{"name": "book", '
     '"arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
     '{"name": "book", "parameters": {"n": [1, 2]}}'),
    ("mistral", 'Ok [TOOL_CALLS][{"name": "get_weather", "arguments": {"c": "X"}}, '
     '{"name": "book", "arguments": {}}]'),
    ("generic", '{"tool_calls":[{"name":"get_weather","arguments":{"c":"]}"}},'
     '{"name":"book","arguments":{}}]}'),
    ("hermes", "Just text with a <tool and < signs."),
    ("llama3_json", "  Plain words."),
    ("generic", "Plain text, no call."),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "text"), STREAMED, ids=[f"{f}-{i}" for i, (f, _) in
                                                         enumerate(STREAMED)])  # fmt: skip
def test_a_streamed_answer_adds_up_to_its_parse(fmt, text) -> None:
    """Fed one character at a time, the content and call deltas add up to what the whole
    text parses to; a call's name comes first and its arguments in several deltas."""
    setup = tool_setup(TOOLS, "auto", fmt)
    stream = ToolCallStream(setup)
    content, names, args, pieces = "", {}, {}, 0
    steps = [stream.feed(ch) for ch in text]
    last = stream.finish("stop")
    for delta, calls in [*steps, last[:2]]:
        content += delta
        for call in calls:
            i = call["index"]
            if "id" in call:
                assert i not in names and call["id"].startswith("call-")
                names[i] = call["function"]["name"]
            args[i] = args.get(i, "") + call["function"]["arguments"]
            pieces += 1
    expected_content, expected_calls = setup.parse(text)
    assert last[2] == ("tool_calls" if expected_calls else "stop")
    assert [names[i] for i in sorted(names)] == [c.name for c in expected_calls]
    assert [args[i] for i in sorted(args)] == [c.arguments for c in expected_calls]
    if expected_calls:
        assert pieces > len(expected_calls) + 1  # the arguments really streamed
        assert content.strip() == (expected_content or "")
    else:
        assert content == text


def _streamed(setup, text: str, finish_reason: str) -> tuple[str, list[tuple], str | None]:
    """What a client makes of `text` streamed one character at a time and finished with
    `finish_reason`: the content, each call's (name, arguments), the finish_reason."""
    stream = ToolCallStream(setup)
    content, calls = "", {}
    last = stream.finish  # called after the feeds below
    deltas = [stream.feed(ch) for ch in text]
    rest, more, finish = last(finish_reason)
    for delta, call_deltas in [*deltas, (rest, more)]:
        content += delta
        for call in call_deltas:
            name, args = calls.get(call["index"], (None, ""))
            calls[call["index"]] = (name or call["function"]["name"],
                                    args + call["function"]["arguments"])  # fmt: skip
    return content, [calls[i] for i in sorted(calls)], finish


CUT_OFF = [(fmt, text, "auto") for fmt, text in STREAMED[:4]] + [
    ("generic", '{"tool_calls":[{"name":"get_weather","arguments":{"c":"P"}},'
     '{"name":"book","arguments":{}},{"name":"get_weather","arguments":{"c":"Q"}}]}', "required"),
    ("hermes", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
     '{"name": "book", "parameters": {"n": [1, 2]}}]', "required"),  # JSON array, any format
    ("mistral", 'Ok [TOOL_CALLS]get_weather[ARGS]{"c": "X"}[TOOL_CALLS]book[ARGS]{}', "auto"),
    ("hermes", "Just text with a <tool and < signs.", "auto"),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "text", "mode"), CUT_OFF,
                         ids=[f"{f}-{m}-{i}" for i, (f, _, m) in enumerate(CUT_OFF)])  # fmt: skip
def test_an_answer_cut_off_anywhere_reads_the_same_whole_and_streamed(fmt, text, mode) -> None:
    """max_tokens may end an answer at any character: whole or streamed, it gives the same
    calls (the complete ones, and an unfinished last one as far as the stream sent it), the
    same content and finish_reason "length"."""
    setup = tool_setup(TOOLS, mode, fmt)
    made_calls = False
    for cut in range(len(text) + 1):
        whole_content, whole_calls, whole_finish = setup.read(text[:cut], "length")
        content, calls, finish = _streamed(setup, text[:cut], "length")
        where = f"cut at {cut}: {text[:cut]!r}"
        assert finish == whole_finish == "length", where
        named = [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]
        assert calls == named, where
        assert content.strip() == (whole_content or "").strip(), where
        made_calls = made_calls or bool(calls)
    assert made_calls == (setup.parse(text)[1] != [])


def test_a_cut_off_required_answer_keeps_its_complete_calls() -> None:
    """The issue's case: SmolLM2 repeating its call until max_tokens, whole and streamed."""
    setup = tool_setup(WEATHER, "required", "generic")
    call = '{"name":"get_weather","arguments":{"city":"Paris"}}'
    text = '{"tool_calls":[' + ",".join([call] * 3) + ',{"name":"get_weather","arguments":{"ci'
    content, calls, finish = setup.read(text, "length")
    assert content is None and finish == "length"
    assert [c["function"]["arguments"] for c in calls] == ['{"city":"Paris"}'] * 3 + ['{"ci']
    assert _streamed(setup, text, "length")[1:] == (
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
        "length",
    )
    # Finished whole (not cut off), the same calls read as "tool_calls".
    whole = '{"tool_calls":[' + ",".join([call] * 3) + "]}"
    assert setup.read(whole, "stop")[2] == "tool_calls" and len(setup.read(whole, "stop")[1]) == 3


def test_a_named_function_cut_off_is_its_call_whole_and_streamed() -> None:
    setup = tool_setup(TOOLS, {"type": "function", "function": {"name": "book"}}, "generic")
    content, calls, finish = setup.read('{"n": [1, 2', "length")
    assert content is None and finish == "length"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("book", '{"n": [1, 2')
    ]
    assert setup.read('{"n": []}', "stop")[1][0]["function"]["arguments"] == '{"n": []}'


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>", "hermes"),
        ('{{- "<|python_tag|>" }}{"name": ..., "parameters": ...}{{ tools }}', "llama3_json"),
        ("{{ '[TOOL_CALLS]' }}{{ tools }}", "mistral"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "generic"),
        (None, "generic"),
    ],
)
def test_the_tool_call_format_is_read_from_the_chat_template(template, fmt) -> None:
    assert detect_tool_format(template) == fmt


@pytest.mark.parametrize("content", [{"content": None}, {}, {"content": [{"type": "text",
                                     "text": "Checking."}]}])  # fmt: skip
def test_an_assistant_tool_call_message_is_rendered_with_string_content_and_object_arguments(
    content,
) -> None:
    call = {"id": "call-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    dumped = ChatMessage(role="assistant", tool_calls=[call], **content).for_template()
    assert dumped["content"] == ("" if not content.get("content") else content["content"])
    assert dumped["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert dumped["tool_calls"][0]["id"] == "call-1"


def test_the_fallback_writes_tools_calls_and_results_into_plain_messages() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]  # fmt: skip
    out = fallback_messages(messages, "TOOLS HERE")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"] == "TOOLS HERE"
    assert json.loads(out[2]["content"]) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Oslo"}}]}  # fmt: skip
    assert "tool_calls" not in out[2]
    results = [json.loads(line)["tool_response"] for line in out[3]["content"].splitlines()]
    assert results == [
        {"name": "get_weather", "tool_call_id": "c1", "content": "sunny"},
        {"name": "get_weather", "tool_call_id": "c2", "content": "rain"},
    ]
    with_system = fallback_messages([{"role": "system", "content": "Be brief."}], "TOOLS")
    assert with_system == [{"role": "system", "content": "Be brief.\n\nTOOLS"}]


def _accepts(so, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(
        _byte_compiler().compile_grammar(build_grammar(so)), terminate_without_stop_token=True
    )
    return matcher.accept_string(text) and matcher.is_terminated()


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
ONE = '{"name":"get_weather","parameters":{"city":"Oslo"}}'


@pytest.mark.parametrize("parallel", [True, False])
def test_the_generic_grammar_allows_text_or_calls_and_one_without_parallel_calls(parallel):
    so = tool_setup(WEATHER, "auto", "generic", parallel).constraint()
    call = '{"name":"get_weather","arguments":{"city":"Oslo"}}'
    assert _accepts(so, "It is sunny {maybe}.") and _accepts(so, "")
    assert _accepts(so, '{"tool_calls":[' + call + "]}")
    assert _accepts(so, '{"tool_calls":[' + call + "," + call + "]}") == parallel
    assert not _accepts(so, '{"tool_calls":[{"name":"get_weather","arguments":{}}]}')
    assert not _accepts(so, ' {"tool_calls":[' + call + "]}")  # no text that looks like one
    required = tool_setup(WEATHER, "required", "generic", parallel).constraint()
    assert not _accepts(required, "Plain text.")
    assert _accepts(required, '{"tool_calls":[' + call + "," + call + "]}") == parallel


def test_parallel_tool_calls_false_allows_at_most_one_call_in_every_format() -> None:
    assert tool_setup(WEATHER, "auto", "hermes", True).constraint() is None
    hermes = tool_setup(WEATHER, "auto", "hermes", False)
    assert hermes.constraint() is None and hermes.stop() == ["</tool_call>"]
    llama = tool_setup(WEATHER, "auto", "llama3_json", False).constraint()
    assert _accepts(llama, ONE) and _accepts(llama, "Text.")
    assert not _accepts(llama, ONE + "; " + ONE)
    mistral = tool_setup(WEATHER, "auto", "mistral", False).constraint()
    call = '{"name":"get_weather","arguments":{"city":"Oslo"}}'
    assert _accepts(mistral, f"[{call}]") and not _accepts(mistral, f"[{call},{call}]")
    required = tool_setup(WEATHER, "required", "llama3_json", False).constraint()
    assert _accepts(required, f"[{ONE}]") and not _accepts(required, f"[{ONE},{ONE}]")


def test_tool_choice_none_and_no_tools_constrain_nothing() -> None:
    assert tool_setup(TOOLS, "none", "generic").constraint() is None
    assert tool_setup(None, None, "hermes") is None
    assert tool_setup(TOOLS, None, "hermes").mode == "auto"  # the default with tools

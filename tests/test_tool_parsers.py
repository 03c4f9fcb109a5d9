"""Tool-call parsers on canned model text, and the tool setups that need no model."""

from __future__ import annotations

import json

import pytest

from conveyor.server.errors import APIError
from conveyor.server.tool_parsers import ToolCall, parse_hermes, parse_llama3_json
from conveyor.server.tools import tool_setup

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
    setup = tool_setup(tools, "required", None)
    schema = json.loads(setup.constraint().spec)
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["a"], ["b"]]
    content, calls, finish = setup.read('[{"name":"b","parameters":{"q":1}}]', "stop")
    assert content is None and finish == "tool_calls"
    assert calls[0]["function"] == {"name": "b", "arguments": '{"q": 1}'}
    # Cut off by max_tokens: no call is made up from half an array.
    assert setup.read('[{"name":"b","param', "length") == ('[{"name":"b","param', [], "length")


def test_auto_needs_a_parser_and_none_constrains_nothing() -> None:
    tools = [{"type": "function", "function": {"name": "a"}}]
    with pytest.raises(APIError, match="--tool-call-parser") as refused:
        tool_setup(tools, None, None)
    assert refused.value.param == "tool_choice"
    assert tool_setup(tools, "none", None).constraint() is None
    assert tool_setup(None, None, None) is None

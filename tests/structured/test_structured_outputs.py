"""Structured outputs and tool calling through a real `conveyor serve` and the official
openai SDK.

The demo model's weights are random: every valid JSON object, regex match or choice below is
the grammar's doing alone.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from tests.serve_process import start_server
from tests.structured.structured_schemas import SCHEMAS, Codes, Customer, Order, Person

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

MODEL = "demo"


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    args = ["--model", str(demo_model_dir), "--served-model-name", MODEL, "--num-kv-blocks", "256",
            "--tool-call-parser", "hermes"]  # fmt: skip
    proc = start_server(args, tmp_path_factory.mktemp("serve"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _ask(name: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Describe a {name} as JSON."}]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[s.__name__ for s in SCHEMAS])
def test_parse_returns_a_valid_object_for_every_schema_greedy(client, schema) -> None:
    resp = client.beta.chat.completions.parse(
        model=MODEL, messages=_ask(schema.__name__), response_format=schema,
        temperature=0.0, max_tokens=300,
    )  # fmt: skip
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, schema)
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 0


def test_sampled_n_choices_all_parse_for_every_schema(client) -> None:
    def one(schema):
        return schema, client.beta.chat.completions.parse(
            model=MODEL, messages=_ask(schema.__name__), response_format=schema,
            temperature=1.0, seed=7, n=3, max_tokens=300,
        )  # fmt: skip

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # all at once: one batch
        results = list(pool.map(one, SCHEMAS))
    for schema, resp in results:
        assert len(resp.choices) == 3
        for choice in resp.choices:
            assert choice.finish_reason == "stop", choice.message.content
            assert isinstance(choice.message.parsed, schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_streamed_structured_output_parses(client, temperature) -> None:
    for schema in (Customer, Order, Codes):
        with client.beta.chat.completions.stream(
            model=MODEL, messages=_ask(schema.__name__), response_format=schema,
            temperature=temperature, seed=3, max_tokens=300,
        ) as stream:  # fmt: skip
            deltas = [e.delta for e in stream if e.type == "content.delta"]
            final = stream.get_final_completion()
        assert len(deltas) > 1  # it really streamed
        assert final.choices[0].finish_reason == "stop"
        assert isinstance(final.choices[0].message.parsed, schema)
        assert "".join(deltas) == final.choices[0].message.content


def test_unconstrained_requests_in_a_mixed_batch_keep_their_tokens(client) -> None:
    prompts = ["def fibonacci(n):", "import os\nimport sys", "class Stack:"]

    def plain(prompt):
        resp = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return resp.choices[0].text

    def constrained(schema):
        return client.beta.chat.completions.parse(
            model=MODEL, messages=_ask(schema.__name__), response_format=schema,
            temperature=1.0, seed=1, n=2, max_tokens=300,
        )  # fmt: skip

    alone = [plain(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        grammar_runs = [pool.submit(constrained, s) for s in (Customer, Order, Person, Codes)]
        mixed = list(pool.map(plain, prompts))
        for run in grammar_runs:
            assert all(c.message.parsed is not None for c in run.result().choices)
    assert mixed == alone


def test_regex_and_choice_constraints(client) -> None:
    pattern = r"[a-z]{3}-[0-9]{2,4}"
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        resp = client.completions.create(
            model=MODEL, prompt="code:", max_tokens=20, temperature=1.0, n=4, seed=2,
            extra_body=body,
        )  # fmt: skip
        for choice in resp.choices:
            assert re.fullmatch(pattern, choice.text), choice.text
            assert choice.finish_reason == "stop"
    options = ["yes", "no", "it depends"]
    for body in ({"structured_outputs": {"choice": options}}, {"guided_choice": options}):
        resp = client.chat.completions.create(
            model=MODEL, messages=_ask("answer"), temperature=1.0, n=5, seed=4, extra_body=body
        )
        assert {c.message.content for c in resp.choices} <= set(options)


def test_json_object_and_guided_json_on_completions(client) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="{", max_tokens=200, temperature=0.0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert isinstance(json.loads(resp.choices[0].text), dict)
    schema = Person.model_json_schema()
    resp = client.completions.create(
        model=MODEL, prompt="person:", max_tokens=200, temperature=0.7, seed=5, n=2,
        extra_body={"guided_json": schema},
    )  # fmt: skip
    for choice in resp.choices:
        Person.model_validate_json(choice.text)
        # Compact by default: no whitespace between JSON tokens.
        outside_strings = re.sub(r'"[^"]*"', '""', choice.text)
        assert re.search(r"[,:{}\[\]]\s|\s[,:{}\[\]]", outside_strings) is None


def test_free_whitespace_is_selectable(client) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="person:", max_tokens=300, temperature=0.0,
        extra_body={"structured_outputs": {"json": Codes.model_json_schema(),
                                           "disable_any_whitespace": False}},
    )  # fmt: skip
    choice = resp.choices[0]
    if choice.finish_reason == "stop":  # free whitespace may run to max_tokens: still JSON text
        Codes.model_validate_json(choice.text)
    assert choice.text.lstrip().startswith("{")


BAD = [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), BAD, ids=[b[1] for b in BAD])
def test_a_constraint_that_cannot_compile_is_a_400_naming_the_field(client, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=_ask("x"), extra_body=body)
    assert refused.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", extra_body=body)
    assert refused.value.body["param"] == param


# -------------------------------------------------------------------- tool calling
class Weather(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["c", "f"]


class Booking(BaseModel):
    room: int = Field(ge=1, le=500)
    nights: int = Field(ge=1, le=14)


def _tool(name: str, model: type[BaseModel]) -> dict:
    schema = model.model_json_schema()
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [_tool("get_weather", Weather), _tool("book_room", Booking)]
ARGUMENTS = {"get_weather": Weather, "book_room": Booking}


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call-")
        ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)
    assert len({c.id for c in calls}) == len(calls)


def test_required_tool_choice_returns_calls_that_match_their_tool(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=_ask("trip"), tools=TOOLS, tool_choice="required",
        temperature=1.0, seed=2, n=3, max_tokens=400,
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls)


def test_a_named_function_is_called_with_valid_arguments(client) -> None:
    for temperature in (0.0, 1.0):
        resp = client.chat.completions.create(
            model=MODEL, messages=_ask("booking"), tools=TOOLS, temperature=temperature,
            tool_choice={"type": "function", "function": {"name": "book_room"}},
        )  # fmt: skip
        choice = resp.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "book_room"
        Booking.model_validate_json(call.function.arguments)


def test_streamed_tool_calls_arrive_as_openai_tool_call_deltas(client) -> None:
    """Each call's first delta carries its index, id and name; its arguments follow in more
    deltas of the same index, as OpenAI and vLLM stream them."""
    stream = client.chat.completions.create(
        model=MODEL, messages=_ask("weather"), tools=TOOLS, tool_choice="required",
        temperature=1.0, seed=5, max_tokens=400, stream=True,
    )  # fmt: skip
    calls, finish, num_deltas = [], None, 0
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                num_deltas += 1
                if delta.index == len(calls):  # a new call: its id and name come first
                    assert delta.id and delta.function.name
                    calls.append(delta.model_copy(deep=True))
                else:
                    assert delta.index == len(calls) - 1 and delta.id is None
                    calls[-1].function.arguments += delta.function.arguments
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert num_deltas > len(calls)  # the arguments streamed
    _check_calls(calls)


def test_a_named_function_streams_its_arguments(client) -> None:
    with client.chat.completions.stream(
        model=MODEL, messages=_ask("booking"), tools=TOOLS, temperature=1.0, seed=9,
        tool_choice={"type": "function", "function": {"name": "book_room"}},
    ) as stream:  # fmt: skip
        pieces = [
            e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"
        ]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "book_room" and call.id.startswith("call-")
    assert len(pieces) > 1 and "".join(pieces) == call.function.arguments
    Booking.model_validate_json(call.function.arguments)
    assert final.choices[0].finish_reason == "stop"


def test_auto_reads_plain_text_as_content_and_the_tools_reach_the_template(client) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=_ask("x"), max_tokens=8)
    resp = client.chat.completions.create(
        model=MODEL, messages=_ask("x"), tools=TOOLS, max_tokens=8, temperature=0.0
    )
    choice = resp.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    assert choice.message.content is not None
    assert resp.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools' system turn


def test_a_history_with_tool_calls_and_tool_results_is_accepted(client) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
        }]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21"},
    ]  # fmt: skip
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert resp.choices[0].message.content is not None and not resp.choices[0].message.tool_calls


TOOL_ERRORS = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
]  # fmt: skip


def test_a_forced_call_with_a_response_format_still_calls(client) -> None:
    """A forced call writes no text, so the format has nothing to govern (instructor sends
    both: a named tool_choice and the same schema as response_format)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        resp = client.chat.completions.create(
            model=MODEL, messages=_ask("x"), tools=TOOLS, tool_choice=choice,
            response_format=fmt, max_tokens=200,
        )  # fmt: skip
        assert resp.choices[0].message.tool_calls, resp


@pytest.mark.parametrize(("body", "param"), TOOL_ERRORS, ids=[str(i) for i in range(4)])
def test_bad_tool_requests_are_a_400_naming_the_field(client, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=_ask("x"), extra_body=body)
    assert refused.value.body["param"] == param

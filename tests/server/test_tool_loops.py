"""Tool loops through a real `conveyor serve` and the official openai SDK's loop
(`messages.append(completion.choices[0].message)`, then the tool results, another round), with
no --tool-call-parser: the format is read from the chat template.

Two servers on the demo checkpoint, each with its tokenizer files carrying a template written
like a real one: Qwen2.5's (hermes `<tool_call>`) and Llama 3.1's (JSON with "parameters").
The weights are random, so the calls of a first round are forced (tool_choice "required" or a
named function); what the templates make of the loop is checked in the prompt they render
(/tokenize, then /detokenize). The generic fallback (a template without tools) runs here as a
request template; tests/model/test_smollm2.py runs it on the real SmolLM2.
"""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from tests.serve_process import ServeProcess

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

# The text of Qwen2.5-Instruct's template (tokenizer_config.json), only the default system
# prompt shortened.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

# Llama-3.1-Instruct's template: tools in the first user message, one call per assistant
# turn, tool results as `ipython` turns (its builtin-tools branch kept short).
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {{- ")" }}
        {%- else %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501

# SmolLM2-Instruct's template: it never mentions tools and prints message['content'].
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                      "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "parameters": CITY}},
]  # fmt: skip
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


def _checkpoint(demo_model_dir, path, template):
    shutil.copytree(demo_model_dir, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def servers(demo_model_dir, tmp_path_factory):
    """{"qwen": ..., "llama": ...}: both load at once."""
    tmp = tmp_path_factory.mktemp("tool-loops")
    common = ["--num-kv-blocks", "256", "--max-model-len", "2048", "--served-model-name", "m"]
    procs = {}
    for name, template in (("qwen", QWEN25_TEMPLATE), ("llama", LLAMA31_TEMPLATE)):
        model = _checkpoint(demo_model_dir, tmp / name, template)
        extra = ["--trust-request-chat-template"] if name == "qwen" else []
        procs[name] = ServeProcess(["--model", str(model), *common, *extra], tmp / f"{name}.log")
    try:
        for proc in procs.values():
            proc.wait_ready(timeout=240)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _rendered(server, messages) -> str:
    """The prompt the server's template makes of `messages` (SDK objects or dicts)."""
    dumped = [m if isinstance(m, dict) else m.model_dump(exclude_unset=True) for m in messages]
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": dumped}, timeout=60)
    assert tokens.status_code == 200, tokens.text
    text = httpx.post(
        f"{server.base_url}/detokenize", json={"tokens": tokens.json()["tokens"]}, timeout=60
    )
    return text.json()["prompt"]


def _tool_results(messages, message) -> None:
    """The SDK loop: the assistant message as it came, then one result per call."""
    messages.append(message)
    for call in message.tool_calls:
        assert json.loads(call.function.arguments)["city"] is not None
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"sunny {call.id}"})


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_the_openai_sdk_tool_loop_runs_three_rounds(servers, family) -> None:
    """Round 1 forces calls, round 2 leaves tool_choice at its default ("auto": needs no
    --tool-call-parser now) with the assistant message sent back as the SDK got it
    (`content: null`), round 3 calls again; the template renders each call and result."""
    server, client = servers[family], _client(servers[family])
    # Llama 3.1's template takes one call per turn: parallel_tool_calls=false makes it one.
    parallel = family == "qwen"
    messages: list = [QUESTION]
    first = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, tool_choice="required", temperature=1.0,
        seed=1, n=1, max_tokens=200, parallel_tool_calls=parallel,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert parallel or len(choice.message.tool_calls) == 1
    _tool_results(messages, choice.message)
    second = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, max_tokens=8, temperature=0.0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    messages.append(second.choices[0].message)
    messages.append({"role": "user", "content": "And the time there?"})
    third = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, max_tokens=200, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    (call,) = third.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _tool_results(messages, third.choices[0].message)

    prompt = _rendered(server, messages)
    for message in (choice.message, third.choices[0].message):
        for c in message.tool_calls:
            arguments = json.dumps(json.loads(c.function.arguments), ensure_ascii=False)
            if family == "qwen":
                expected = f'<tool_call>\n{{"name": "{c.function.name}", "arguments": {arguments}}}'
            else:
                expected = f'{{"name": "{c.function.name}", "parameters": {arguments}}}'
            assert expected in prompt
    for message in messages:
        if isinstance(message, dict) and message["role"] == "tool":
            if family == "qwen":
                assert f"<tool_response>\n{message['content']}\n</tool_response>" in prompt
            else:
                assert f"ipython<|end_header_id|>\n\n{json.dumps(message['content'])}" in prompt


CALL = {"id": "call-7", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
SHAPES = {
    "content null": {"role": "assistant", "content": None, "tool_calls": [CALL]},
    "no content": {"role": "assistant", "tool_calls": [CALL]},
    "content string": {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
    "content parts": {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
                      "tool_calls": [CALL]},
}  # fmt: skip


@pytest.mark.parametrize("family", ["qwen", "llama"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_assistant_message_shape_renders_its_call(servers, family, shape) -> None:
    result = {"role": "tool", "tool_call_id": "call-7", "content": "cold"}
    prompt = _rendered(servers[family], [QUESTION, SHAPES[shape], result])
    if family == "qwen":
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
        assert ("Checking." in prompt) == (shape in ("content string", "content parts"))
    else:
        assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in prompt


def test_a_streamed_auto_answer_arrives_token_by_token(servers) -> None:
    """With tools and tool_choice left at "auto", text streams as it comes (no call begins
    in it), and adds up to the answer a plain request gets."""
    client = _client(servers["qwen"])
    body = dict(model="m", messages=[QUESTION], tools=TOOLS, max_tokens=24, temperature=0.0)
    whole = client.chat.completions.create(**body).choices[0]
    pieces = []
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            assert not c.delta.tool_calls
            pieces += [c.delta.content] if c.delta.content else []
    if whole.message.tool_calls:
        pytest.skip("the random model wrote a <tool_call>")
    # (a client that falls behind gets waiting deltas folded: there may be a single piece)
    assert pieces and "".join(pieces) == whole.message.content


def test_parallel_tool_calls_false_makes_at_most_one_call(servers) -> None:
    """Llama 3.1's format under "auto": the grammar allows text or one call; "required": one."""
    client = _client(servers["llama"])
    auto = client.chat.completions.create(
        model="m", messages=[QUESTION], tools=TOOLS, parallel_tool_calls=False, n=4,
        temperature=1.0, seed=3, max_tokens=60,
    )  # fmt: skip
    for choice in auto.choices:
        assert len(choice.message.tool_calls or []) <= 1
        if not choice.message.tool_calls and choice.finish_reason != "length":
            assert not choice.message.content.lstrip().startswith("{")
    required = _client(servers["qwen"]).chat.completions.create(
        model="m", messages=[QUESTION], tools=TOOLS, tool_choice="required", n=4,
        parallel_tool_calls=False, temperature=1.0, seed=3, max_tokens=200,
    )  # fmt: skip
    assert [len(c.message.tool_calls) for c in required.choices] == [1] * 4


def test_a_template_without_tools_gets_the_generic_fallback(servers) -> None:
    """SmolLM2's template (as the request's own): the tools reach the model in a system
    message, a forced call streams as deltas in the JSON envelope, and the loop's history
    (the call, its result) is written into messages that template can print."""
    client = _client(servers["qwen"])
    extra = {"chat_template": SMOLLM2_TEMPLATE}
    plain = client.chat.completions.create(
        model="m", messages=[QUESTION], max_tokens=1, extra_body=extra
    )
    with client.chat.completions.stream(
        model="m", messages=[QUESTION], tools=TOOLS, tool_choice="required", temperature=1.0,
        seed=4, max_tokens=200, parallel_tool_calls=False, extra_body=extra,
        stream_options={"include_usage": True},
    ) as stream:  # fmt: skip
        pieces = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert len(pieces) > 1 and final.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    messages: list = [QUESTION]
    _tool_results(messages, choice.message)
    auto = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, n=3, temperature=1.0, seed=5,
        max_tokens=60, extra_body=extra,
    )  # fmt: skip
    for c in auto.choices:  # the grammar's doing: text, or calls that parse
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            for call in c.message.tool_calls:
                assert json.loads(call.function.arguments)["city"] is not None
        elif c.finish_reason != "length":  # (a call cut short stays text)
            assert not (c.message.content or "").startswith("{")


def test_the_generic_fallback_refuses_a_format_only_where_text_may_come(servers) -> None:
    """Under "auto" the fallback's grammar (text or a call) cannot also hold the text to a
    format: a 400 naming tool_choice; a forced call writes no text, so the format is moot."""
    client = _client(servers["qwen"])
    body = dict(model="m", messages=[QUESTION], tools=TOOLS, max_tokens=200)
    extra = {"chat_template": SMOLLM2_TEMPLATE}
    fmt = {"type": "json_object"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**body, response_format=fmt, extra_body=extra)
    assert refused.value.body["param"] == "tool_choice"
    forced = client.chat.completions.create(
        **body, tool_choice="required", parallel_tool_calls=False, response_format=fmt,
        extra_body=extra,
    )  # fmt: skip
    assert forced.choices[0].message.tool_calls

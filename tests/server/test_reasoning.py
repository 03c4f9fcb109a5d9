"""Reasoning parsers (server/reasoning.py): the `<think>…</think>` part of a chat answer as
`reasoning_content`, whole and streamed, and through a real `conveyor serve` with the official
openai client.

The server's model is a real checkpoint whose weights make its greedy output known: every
layer's output projections are zero, so the last hidden state is the current token's
embedding, and the embeddings of a few tokens are orthogonal unit vectors that the LM head maps
to the next token of a fixed chain. Whatever the prompt, the answer is

    <think>Hello world<tool_call>{get_time}</tool_call></think> The quick<tool_call>{get_weather}
    </tool_call>

(each tag and each call one added token of the local tokenizer), so the split, the stream and
tool-call extraction after `</think>` are checked on text the engine really generated. The
server gets no --reasoning-parser: its Qwen3-style template makes it qwen3.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.hf_checkpoints import write_chain_model
from tests.serve_process import serve_folder

from conveyor.server.config import ServerConfig
from conveyor.server.reasoning import (
    REASONING_PARSERS,
    choose_reasoning_parser,
    detect_reasoning_parser,
    generation_prompt,
    reasoning_item,
    thinking_disabled,
)
from conveyor.server.responses import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from conveyor.server.sse import ChatChunks
from conveyor.server.streaming import sse

DEEPSEEK, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]

# Qwen3's template, shortened: tools as hermes <tool_call>s, history loses its thinking;
# enable_thinking=false writes an empty think block into the generation prompt.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\nCall a function as <tool_call>{\"name\": ..., \"arguments\": ...}' }}
    {{- '</tool_call>' }}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
# DeepSeek-R1's way: the generation prompt opens the thinking.
DEEPSEEK_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% else %}<｜Assistant｜>{{ m.content.split('</think>')[-1] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---------------------------------------------------------------- whole answers
@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        (DEEPSEEK, "plan it</think>The answer.", "plan it", "The answer."),
        (DEEPSEEK, "<think>plan it</think>\n\nThe answer.", "plan it", "\n\nThe answer."),
        (DEEPSEEK, "\n<think>plan</think>x", "plan", "x"),
        (DEEPSEEK, "still thinking when cut off", "still thinking when cut off", ""),
        (DEEPSEEK, "</think>only an answer", "", "only an answer"),
        (DEEPSEEK, "a</think>b</think>c", "a", "b</think>c"),
        (QWEN3, "<think>\nplan\n</think>\n\nThe answer.", "\nplan\n", "\n\nThe answer."),
        (QWEN3, "  <think>plan</think>x", "plan", "x"),
        (QWEN3, "<think></think>x", "", "x"),
        (QWEN3, "<think>cut off", "cut off", ""),
        (QWEN3, "no thinking at all</think>", None, "no thinking at all</think>"),
        (QWEN3, "text then <think>a</think>", None, "text then <think>a</think>"),
        (QWEN3, "", None, ""),
    ],
)
def test_split_reads_the_thinking_and_the_answer(parser, text, reasoning, content) -> None:
    assert parser.split(text) == (reasoning, content)


# ---------------------------------------------------------------- streamed answers
def _streamed(parser, deltas: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    stream = parser.stream()
    pieces = [stream.feed(d) for d in deltas] + [stream.finish()]
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces), pieces


SPLIT_TEXTS = [
    "<think>plan it</think>The answer.",
    "\n <think>\nplan</think>\n\nok",
    "plan it</think>The answer.",
    "<think></think>x",
    "<think>a</thin not a tag</think>b",
    "<thi",
    "</thi",
    "<think>never closed </th",
    "plain text, no tags",
    "</think>",
]


@pytest.mark.parametrize("parser", [DEEPSEEK, QWEN3], ids=lambda p: p.name)
@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_stream_with_a_tag_split_at_every_position_joins_to_the_split(parser, text) -> None:
    """Every cut into two deltas and every cut into three: the deltas join to `split`."""
    reasoning, content = parser.split(text)
    expected = (reasoning or "", content)
    for i in range(len(text) + 1):
        assert _streamed(parser, [text[:i], text[i:]])[:2] == expected, i
        for j in range(i, len(text) + 1):
            assert _streamed(parser, [text[:i], text[i:j], text[j:]])[:2] == expected, (i, j)
    assert _streamed(parser, list(text))[:2] == expected  # one character at a time


def test_a_partial_closing_tag_is_held_back_not_sent() -> None:
    stream = DEEPSEEK.stream()
    assert stream.feed("<think>abc</thi") == ("abc", "")
    assert stream.feed("nk") == ("", "")
    assert stream.feed(">answer") == ("", "answer")
    assert stream.feed(" more") == ("", " more")
    assert stream.finish() == ("", "")
    qwen = QWEN3.stream()
    assert qwen.feed("  <thi") == ("", "")  # may still open the thinking
    assert qwen.feed("s is not") == ("", "  <this is not")
    assert qwen.finish() == ("", "")


def test_no_closing_tag_streams_all_as_reasoning() -> None:
    reasoning, content, pieces = _streamed(DEEPSEEK, ["step one", ", step two <", "/"])
    assert (reasoning, content) == ("step one, step two </", "")
    assert pieces[0] == ("step one", "") and pieces[-1] == ("</", "")


_pieces = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "/", "a", " ", "\n", "é"]),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(pieces=_pieces, cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=5))
def test_any_text_cut_anywhere_streams_as_it_splits(pieces, cuts) -> None:
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    for parser in (DEEPSEEK, QWEN3):
        reasoning, content = parser.split(text)
        assert _streamed(parser, deltas)[:2] == (reasoning or "", content)


# ---------------------------------------------------------------- which parser
def _hf_tokenizer(tiny_tokenizer_dir, template):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.chat_template = template
    return tok


def test_the_chat_template_picks_the_parser(tiny_tokenizer_dir) -> None:
    qwen = _hf_tokenizer(tiny_tokenizer_dir, QWEN3_TEMPLATE)
    assert generation_prompt(qwen) == "<|im_start|>assistant\n"
    assert detect_reasoning_parser(QWEN3_TEMPLATE, generation_prompt(qwen)) == "qwen3"
    deepseek = _hf_tokenizer(tiny_tokenizer_dir, DEEPSEEK_TEMPLATE)
    assert generation_prompt(deepseek) == "<｜Assistant｜><think>\n"
    assert detect_reasoning_parser(DEEPSEEK_TEMPLATE, generation_prompt(deepseek)) == (
        "deepseek_r1"
    )
    assert detect_reasoning_parser(PLAIN_TEMPLATE, "<|im_start|>assistant\n") is None
    assert detect_reasoning_parser(None, None) is None
    # A template that cannot be rendered is read from its text: the tags, not opened.
    assert detect_reasoning_parser(QWEN3_TEMPLATE, None) == "qwen3"


def test_the_flag_overrides_the_template(tiny_tokenizer_dir) -> None:
    from conveyor.engine.tokenizer import Tokenizer

    path = tiny_tokenizer_dir.parent / "deepseek-tokenizer"
    if not path.exists():
        _hf_tokenizer(tiny_tokenizer_dir, DEEPSEEK_TEMPLATE).save_pretrained(path)
    tok = Tokenizer.from_pretrained(path)
    assert choose_reasoning_parser(None, tok) is DEEPSEEK
    assert choose_reasoning_parser("none", tok) is None
    assert choose_reasoning_parser("qwen3", tok) is QWEN3
    assert choose_reasoning_parser(None, Tokenizer.from_pretrained(tiny_tokenizer_dir)) is None
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="deepseek")


def test_enable_thinking_false_turns_the_split_off_where_the_template_reads_it() -> None:
    assert thinking_disabled({"enable_thinking": False}, QWEN3_TEMPLATE)
    assert not thinking_disabled({"enable_thinking": True}, QWEN3_TEMPLATE)
    assert not thinking_disabled(None, QWEN3_TEMPLATE)
    # A template that never reads it thinks anyway: the split stays.
    assert not thinking_disabled({"enable_thinking": False}, DEEPSEEK_TEMPLATE)


def test_reasoning_item_for_the_responses_api() -> None:
    item = reasoning_item("plan it")
    assert item["type"] == "reasoning" and item["id"].startswith("rs")
    assert item["content"] == [{"type": "reasoning_text", "text": "plan it"}]


# ---------------------------------------------------------------- stream chunks
@pytest.mark.parametrize("content", [None, "", "answer", 'é "q"\n'])
@pytest.mark.parametrize("reasoning", [None, "", "plan \u2028 it"])
@pytest.mark.parametrize("finish", [None, "stop"])
def test_reasoning_chunks_are_the_models_bytes(content, reasoning, finish) -> None:
    """server/sse.py's fast path writes what the pydantic chunk models would."""
    chunks = ChatChunks("chatcmpl-1", 1_700_000_000, "m", 5, continuous_usage=False)
    got = chunks.choice(0, content, None, finish, None, 3, reasoning)
    fields = {} if content is None else {"content": content}
    if reasoning is not None:
        fields |= {"reasoning_content": reasoning, "reasoning": reasoning}
    choice = ChatCompletionStreamChoice(
        index=0, delta=DeltaMessage(**fields), logprobs=None, finish_reason=finish
    )
    if finish is not None:
        choice.stop_reason = None
    chunk = ChatCompletionStreamResponse(
        id="chatcmpl-1", created=1_700_000_000, model="m", choices=[choice]
    )
    assert got == sse(chunk)


# ---------------------------------------------------------------- a real server
REASONING = 'Hello world<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CONTENT = " The quick" + WEATHER_CALL
RAW = f"<think>{REASONING}</think>{CONTENT}"
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time")
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _chain_checkpoint(tiny_tokenizer_dir, path):
    """A checkpoint whose greedy answer to any prompt ending in a newline is RAW (the
    module docstring)."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.add_tokens(["<think>", "</think>", REASONING[len("Hello world") :], WEATHER_CALL])
    tok.chat_template = QWEN3_TEMPLATE
    pieces = ["\n", "<think>", "Hello", " world", REASONING[len("Hello world") :], "</think>"]
    pieces += [" The", " quick", WEATHER_CALL]
    chain = [tok.encode(p, add_special_tokens=False) for p in pieces]
    assert all(len(ids) == 1 for ids in chain), chain
    chain = [ids[0] for ids in chain] + [tok.eos_token_id]
    assert len(set(chain)) == len(chain)
    assert tok.decode(chain[1:], skip_special_tokens=True) == RAW
    return write_chain_model(tok, chain, path)


@pytest.fixture(scope="module")
def server(tiny_tokenizer_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    with serve_folder(_chain_checkpoint(tiny_tokenizer_dir, tmp / "model"), tmp, "m") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _create(client, **kw):
    return client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=20, temperature=0.0, **kw
    )


@pytest.mark.slow
def test_the_parser_is_read_from_the_template_and_logged(server, client) -> None:
    assert "Reasoning parser: qwen3 (read from the chat template)" in server.log()
    # The engine's own text, unsplit (completions), is the chain's.
    prompt = httpx.post(f"{server.base_url}/tokenize", json={"messages": QUESTION}).json()
    raw = client.completions.create(
        model="m", prompt=prompt["tokens"], max_tokens=20, temperature=0.0
    )
    assert raw.choices[0].text == RAW


@pytest.mark.slow
def test_the_thinking_comes_back_as_reasoning_content(client) -> None:
    message = _create(client).choices[0].message
    assert message.reasoning_content == REASONING
    assert message.model_extra["reasoning"] == REASONING  # vLLM's newer name
    assert message.content == CONTENT


@pytest.mark.slow
def test_streamed_reasoning_deltas_come_first_and_join_to_the_same(client) -> None:
    reasoning, content, kinds = [], [], []
    for chunk in _create(client, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_extra or {}
            if delta.get("reasoning_content"):
                assert delta["reasoning"] == delta["reasoning_content"]
                reasoning.append(delta["reasoning_content"])
                kinds.append("reasoning")
            if choice.delta.content:
                content.append(choice.delta.content)
                kinds.append("content")
    assert "".join(reasoning) == REASONING and "".join(content) == CONTENT
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # all reasoning first


@pytest.mark.slow
def test_tool_calls_are_read_after_the_thinking_only(client) -> None:
    """The get_time call inside the thinking is thought, not called."""
    choice = _create(client, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == REASONING
    assert choice.message.content == "The quick"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})]

    names, arguments, content, finish = [], "", "", None
    for chunk in _create(client, tools=TOOLS, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for call in ch.delta.tool_calls or []:
                names += [call.function.name] if call.function.name else []
                arguments += call.function.arguments or ""
            finish = ch.finish_reason or finish
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"}
    assert content == " The quick" and finish == "tool_calls"


@pytest.mark.slow
def test_enable_thinking_false_splits_nothing(client) -> None:
    message = _create(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert message.choices[0].message.content == RAW
    assert message.choices[0].message.reasoning_content is None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"extra_body": {"guided_regex": "[a-z]+"}}, "guided_regex"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_an_output_constraint_with_a_reasoning_split_is_refused(client, kw, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, **kw)
    error = info.value.body
    assert error["param"] == param and "enable_thinking" in error["message"]

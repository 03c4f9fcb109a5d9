"""gpt-oss's harmony format (server/harmony.py): answers read whole and streamed, as the harmony
reasoning parser and tool-call format, and through a real `conveyor serve` with the official
openai client.

The server's model is a real checkpoint whose greedy answer is known (tests/server/
test_reasoning.py's chain: zeroed output projections, so each token's embedding alone picks
the next): whatever the prompt, it writes HARMONY_ANSWER, its markers special tokens of its
tokenizer (first occurrences) or parts of other tokens (later ones, some split across two),
and ends at `<|call|>`, a stop token the server adds itself (its generation_config does not
name it). The server gets no flag: its template writes `<|channel|>`, so it reads harmony.
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
from conveyor.server.harmony import MARKERS
from conveyor.server.reasoning import (
    HARMONY,
    REASONING_PARSERS,
    choose_reasoning_parser,
    detect_reasoning_parser,
)
from conveyor.server.tool_parsers import TOOL_CALL_PARSERS, detect_tool_format
from conveyor.server.tools import ToolCallStream, tool_setup

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time")
]
THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."
CALL_IN_CHANNEL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)
CALL_IN_ROLE = (
    '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": 1}'
)
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking."


def _read(text: str, finish: str = "stop", choice="auto"):
    """(reasoning, content, [(name, arguments)], finish_reason) as the chat path reads it."""
    reasoning = HARMONY.split(text)[0]
    content, calls, finish = tool_setup(TOOLS, choice, "harmony").read(text, finish)
    return (
        reasoning,
        content,
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
        finish,
    )


# ---------------------------------------------------------------- whole answers
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (THINK + FINAL, ("The user wants the weather.", "It is sunny.", [], "stop")),
        (THINK + FINAL + "<|return|>", ("The user wants the weather.", "It is sunny.", [], "stop")),
        (  # the recipient in the channel's header, with <|constrain|>
            THINK + CALL_IN_CHANNEL,
            (
                "The user wants the weather.",
                None,
                [("get_weather", '{"city": "Paris"}')],
                "tool_calls",
            ),
        ),
        (  # in the role's header; the first message's role is the prompt's
            ' to=functions.get_time<|channel|>commentary json<|message|> {"tz": 1}\n<|call|>',
            (None, None, [("get_time", '{"tz": 1}')], "tool_calls"),
        ),
        (  # two calls, one in each header, after a preamble (content)
            THINK + PREAMBLE + "<|end|>" + CALL_IN_ROLE + "<|end|>" + CALL_IN_CHANNEL,
            (
                "The user wants the weather.",
                "Checking.",
                [("get_time", '{"tz": 1}'), ("get_weather", '{"city": "Paris"}')],
                "tool_calls",
            ),
        ),
        (  # messages of one kind joined with a newline
            THINK + "<|start|>assistant" + THINK + PREAMBLE + "<|end|>" + FINAL,
            (
                "The user wants the weather.\nThe user wants the weather.",
                "Checking.\nIt is sunny.",
                [],
                "stop",
            ),
        ),
        (  # analysis to a built-in tool is still reasoning; a message with no channel: nothing
            "<|channel|>analysis to=browser.search<|message|>{}<|end|><|start|>assistant"
            "<|message|>no channel<|end|>" + FINAL,
            ("{}", "It is sunny.", [], "stop"),
        ),
        (  # <|channel|> with no <|end|> before it ends the message; markers in text stay
            "<|channel|>analysis<|message|>a <|constrain|> b <|message|><|channel|>final"
            "<|message|>answer",
            ("a <|constrain|> b <|message|>", "answer", [], "stop"),
        ),
        ("Plain text, no harmony at all.", (None, None, [], "stop")),  # a header (as vLLM)
        ("", (None, None, [], "stop")),
    ],
)
def test_harmony_answers_read_as_reasoning_content_and_calls(text, expected) -> None:
    reasoning, content, calls, finish = _read(text)
    assert (reasoning, content, calls, finish) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<|channel|>analysis<|message|>The user wa", ("The user wa", None, [])),
        ("<|channel|>analy", (None, None, [])),  # in the header: nothing yet
        (THINK + "<|start|>assistant<|channel|>final<|message|>It is", (
            "The user wants the weather.", "It is", [])),
        (THINK + "<|start|>assistant to=functions.get_wea", ("The user wants the weather.",
                                                             None, [])),
        (THINK + CALL_IN_CHANNEL[:-4], ("The user wants the weather.", None,
                                        [("get_weather", '{"city": "Par')])),
        (THINK + CALL_IN_CHANNEL[: CALL_IN_CHANNEL.index("{")], (
            "The user wants the weather.", None, [("get_weather", "")])),
        ("<|channel|>final<|message|>Done<|en", (None, "Done<|en", [])),  # never a marker
    ],
)  # fmt: skip
def test_an_answer_cut_off_keeps_what_its_last_message_wrote(text, expected) -> None:
    """max_tokens inside a header gives nothing of that message; inside its text, the text so
    far, or the call with its arguments as far as written; finish_reason stays "length"."""
    reasoning, content, calls, finish = _read(text, "length")
    assert (reasoning, content, calls) == expected
    assert finish == "length"


def test_tool_choice_none_and_no_tools_keep_the_calls_out_of_the_content() -> None:
    text = THINK + PREAMBLE + "<|end|>" + CALL_IN_CHANNEL
    assert _read(text, choice="none") == ("The user wants the weather.", "Checking.", [], "stop")
    assert HARMONY.split(text) == ("The user wants the weather.", "Checking.")
    assert tool_setup(TOOLS, "auto", "harmony", False).constraint() is None  # <|call|> stops


# ---------------------------------------------------------------- streamed answers
def _streamed(deltas: list[str], finish: str = "stop"):
    """What a client makes of `deltas`: the reasoning stream's and the tool-call stream's
    deltas joined (reasoning, content, [(name, arguments)], finish_reason)."""
    reasoner = HARMONY.stream()
    calls_stream = ToolCallStream(tool_setup(TOOLS, "auto", "harmony"))
    reasoning, content, calls = "", "", {}
    steps = [(reasoner.feed(d), calls_stream.feed(d)) for d in deltas]
    rest, more, finish = calls_stream.finish(finish)
    steps.append((reasoner.finish(), (rest, more)))
    plain = ""
    for (thought, text), (said, call_deltas) in steps:
        reasoning, plain, content = reasoning + thought, plain + text, content + said
        for call in call_deltas:
            name, args = calls.get(call["index"], ("", ""))
            calls[call["index"]] = (name + call["function"].get("name", ""),
                                    args + call["function"]["arguments"])  # fmt: skip
    return reasoning, content, [calls[i] for i in sorted(calls)], finish, plain


def _agrees(text: str, deltas: list[str], finish: str) -> None:
    reasoning, content, calls, finish_reason = _read(text, finish)
    got = _streamed(deltas, finish)
    assert got[:4] == (reasoning or "", content or "", calls, finish_reason)
    assert got[4] == HARMONY.split(text)[1]  # the reasoning stream's own content


STREAMED = [
    THINK + FINAL,
    THINK + PREAMBLE + "<|end|>" + CALL_IN_ROLE + "<|end|>" + CALL_IN_CHANNEL,
    ' to=functions.get_time<|channel|>commentary json<|message|> {"tz": 1} ',
    "<|channel|>analysis<|message|>a<|constrain|><|message|><|channel|>final<|message|>b<|",
    "<|channel|>final<|message|>x<|end|>junk<|start|>assistant<|channel|>final<|message|>y",
]


@pytest.mark.parametrize("finish", ["stop", "length"])
@pytest.mark.parametrize("text", STREAMED)
def test_a_stream_cut_at_every_position_joins_to_the_whole_reading(text, finish) -> None:
    """Every cut into two deltas, every cut into three, one character at a time, and every
    prefix of the answer (max_tokens there): the deltas join to what the whole answer reads."""
    for i in range(len(text) + 1):
        _agrees(text, [text[:i], text[i:]], finish)
        _agrees(text[:i], [text[:i]], finish)
        for j in range(i, len(text) + 1, 3):
            _agrees(text, [text[:i], text[i:j], text[j:]], finish)
    _agrees(text, list(text), finish)


def test_a_marker_split_across_deltas_is_held_back_not_sent() -> None:
    stream = HARMONY.stream()
    assert stream.feed("<|channel|>final<|mess") == ("", "")
    assert stream.feed("age|>Hello <|e") == ("", "Hello ")
    assert stream.feed("nd|><|start|>assistant<|channel|>final<|message|>x") == ("", "\nx")
    assert stream.feed("<|ca") == ("", "")
    assert stream.finish() == ("", "<|ca")  # it never became a marker


_pieces = st.lists(
    st.sampled_from([
        *MARKERS, "<|", "<|end", "|>", "analysis", "final", "commentary", " to=functions.f",
        " to=functions.g", " to=python", " json", "assistant", "a", " ", "\n", "{", "}", "é",
    ]),
    max_size=24,
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    pieces=_pieces,
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6),
    finish=st.sampled_from(["stop", "length"]),
)
def test_any_text_cut_anywhere_streams_as_it_reads_whole(pieces, cuts, finish) -> None:
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    _agrees(text, deltas, finish)


def test_the_streamed_arguments_come_in_pieces_after_the_name() -> None:
    stream = ToolCallStream(tool_setup(TOOLS, "auto", "harmony"))
    text = THINK + CALL_IN_CHANNEL
    deltas = [d for ch in text for d in stream.feed(ch)[1]]
    first, *rest = deltas
    assert first["function"] == {"name": "get_weather", "arguments": ""} and "id" in first
    assert "".join(d["function"]["arguments"] for d in rest) == '{"city": "Paris"}'
    assert len(rest) > 3


# ---------------------------------------------------------------- which parser
# A chat template in harmony's format (gpt-oss's, much shortened): tools in the system
# message, reasoning_effort read, history's thinking (as gpt-oss's, from `thinking`: the
# server gives a message's reasoning_content that name too) and calls rendered back.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: "
    "{{ reasoning_effort if reasoning_effort is defined else 'medium' }}"
    "{% if tools %}\n# Tools{% for t in tools %}\n{{ t.function.name }}: "
    "{{ t.function.parameters | tojson }}{% endfor %}{% endif %}<|end|>"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m.thinking }}<|end|>{% endif %}"
    "{% for c in m.tool_calls or [] %}<|start|>assistant to=functions.{{ c.function.name }}"
    "<|channel|>commentary json<|message|>{{ c.function.arguments | tojson }}<|call|>"
    "{% endfor %}"
    "{% if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% endif %}"
    "{% elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary"
    "<|message|>{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def test_a_harmony_template_picks_harmony_for_reasoning_and_tools(tiny_tokenizer_dir) -> None:
    assert detect_tool_format(HARMONY_TEMPLATE) == "harmony"
    # gpt-oss's template also says "parameters" and tools, llama3_json's signs: harmony wins.
    assert detect_tool_format(HARMONY_TEMPLATE + '"parameters"') == "harmony"
    assert detect_reasoning_parser(HARMONY_TEMPLATE, None) == "harmony"
    assert REASONING_PARSERS["harmony"] is HARMONY and TOOL_CALL_PARSERS["harmony"].markup
    from conveyor.engine.tokenizer import Tokenizer

    hf = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    hf.chat_template = HARMONY_TEMPLATE
    assert choose_reasoning_parser(None, Tokenizer(hf)) is HARMONY
    assert choose_reasoning_parser("none", Tokenizer(hf)) is None
    config = ServerConfig(reasoning_parser="harmony", tool_call_parser="harmony")
    assert (config.reasoning_parser, config.tool_call_parser) == ("harmony", "harmony")


# ---------------------------------------------------------------- a real server
SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
           "<|call|>"]  # fmt: skip
# The answer's tokens: the first of each marker a special token, later ones inside others.
PIECES = [
    "<|channel|>", "analysis", "<|message|>", "Weather", " in Paris.", "<|end|>",
    "<|start|>", "assistant<|channel|>commentary", "<|me", "ssage|>", "Checking.",
    "<|end|><|start|>assistant<|channel|>final<|message|>", "It is", " sunny.",
    "<|end|><|st", "art|>assistant to=functions.get_weather<|channel|>commentary json",
    "<|message|>{", '"city": ', '"Paris"}', "<|end|><|start|>assistant<|channel|>commentary "
    "to=functions.get_time <|constrain|>json<|message|>", "{}", "<|call|>",
]  # fmt: skip
HARMONY_ANSWER = "".join(PIECES[:-1])  # <|call|> ends it, its text left out
REASONING = "Weather in Paris."
CONTENT = "Checking.\nIt is sunny."
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _chain_checkpoint(tiny_tokenizer_dir, path):
    """A checkpoint whose greedy answer to any prompt ending in `<|start|>assistant` is
    PIECES, then `Hello` if nothing stopped it at `<|call|>` (the module docstring)."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.add_tokens(["assistant", *(p for p in PIECES if p not in SPECIAL), "Hello"])
    tok.chat_template = HARMONY_TEMPLATE
    # By id: a piece holding a special token's text never encodes as one token.
    chain = [tok.convert_tokens_to_ids(p) for p in ["assistant", *PIECES, "Hello"]]
    chain.append(tok.eos_token_id)
    assert len(set(chain)) == len(chain) and len(tok) - 1 in chain
    assert tok.decode(chain[1:-3], skip_special_tokens=False) == HARMONY_ANSWER
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    assert prompt[-1] == chain[0]
    return write_chain_model(tok, chain, path)  # eos, not <|call|>: the server adds it


@pytest.fixture(scope="module")
def server(tiny_tokenizer_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harmony")
    with serve_folder(_chain_checkpoint(tiny_tokenizer_dir, tmp / "model"), tmp, "m") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _chat(client, **kw):
    kw.setdefault("max_tokens", 40)
    return client.chat.completions.create(model="m", messages=QUESTION, temperature=0.0, **kw)


def _chat_streamed(client, **kw):
    """(reasoning, content, [(name, arguments)], finish_reason, order of the kinds)."""
    reasoning, content, calls, finish, kinds = "", "", {}, None, []
    for chunk in _chat(client, stream=True, **kw):
        for ch in chunk.choices:
            delta = ch.delta.model_extra or {}
            if delta.get("reasoning_content"):
                assert delta["reasoning"] == delta["reasoning_content"]
                reasoning += delta["reasoning_content"]
                kinds.append("reasoning")
            if ch.delta.content:
                content += ch.delta.content
                kinds.append("content")
            for call in ch.delta.tool_calls or []:
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""),
                                     args + (call.function.arguments or ""))  # fmt: skip
                kinds.append("call")
            finish = ch.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish, kinds


def _whole(choice):
    message = choice.message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.reasoning_content, message.content, calls, choice.finish_reason


@pytest.mark.slow
def test_the_template_picks_harmony_and_the_engine_writes_the_answer(server, client) -> None:
    assert "Reasoning parser: harmony (read from the chat template)" in server.log()
    prompt = httpx.post(f"{server.base_url}/tokenize", json={"messages": QUESTION}).json()
    raw = client.completions.create(
        model="m", prompt=prompt["tokens"], max_tokens=len(PIECES), temperature=0.0,
        extra_body={"skip_special_tokens": False},
    )  # fmt: skip
    assert raw.choices[0].text == HARMONY_ANSWER + "<|call|>"


@pytest.mark.slow
def test_chat_reads_reasoning_content_and_calls_whole_and_streamed(server, client) -> None:
    whole = _chat(client, tools=TOOLS).choices[0]
    assert _whole(whole) == (REASONING, CONTENT, CALLS, "tool_calls")
    call = httpx.post(
        f"{server.base_url}/tokenize", json={"prompt": "<|call|>", "add_special_tokens": False}
    ).json()["tokens"]
    assert [whole.model_extra["stop_reason"]] == call  # the stop token the server added
    reasoning, content, calls, finish, kinds = _chat_streamed(client, tools=TOOLS)
    assert (reasoning, content, calls, finish) == (REASONING, CONTENT, CALLS, "tool_calls")
    assert kinds == sorted(kinds, key=["reasoning", "content", "call"].index)
    assert all(json.loads(args) is not None for _, args in calls)
    # Without tools (or with tool_choice "none") the calls are no content.
    for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        assert _whole(_chat(client, **kw).choices[0]) == (REASONING, CONTENT, [], "stop")
        assert _chat_streamed(client, **kw)[:4] == (REASONING, CONTENT, [], "stop")


@pytest.mark.slow
def test_an_answer_cut_anywhere_reads_the_same_whole_and_streamed(client) -> None:
    """max_tokens at every token of the answer: the non-streamed and streamed answers agree,
    and both are what the harmony reader makes of the text written so far."""
    for n in range(1, len(PIECES) + 1):
        text = "".join(PIECES[:n])  # (<|call|>'s text is left out, and reads the same)
        finish = "length" if n < len(PIECES) else "stop"
        reasoning, content, calls, expected_finish = _read(text, finish)
        expected = (reasoning or None, content, calls, expected_finish)
        assert _whole(_chat(client, tools=TOOLS, max_tokens=n).choices[0]) == expected, n
        streamed = _chat_streamed(client, tools=TOOLS, max_tokens=n)
        assert streamed[:4] == (reasoning or "", content or "", calls, expected_finish), n


def _items(response) -> list[tuple]:
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", item.content[0].text, item.status))
        elif item.type == "message":
            out.append(("message", item.content[0].text, item.status))
        else:
            out.append((item.type, item.name, item.arguments, item.status))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("max_output_tokens", [40, 4, 12, 19])
def test_responses_items_whole_and_streamed(client, max_output_tokens) -> None:
    body = dict(model="m", input=QUESTION, tools=[{"type": "function", **t["function"]}
                for t in TOOLS], max_output_tokens=max_output_tokens, temperature=0.0)  # fmt: skip
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    last = events[-1].response
    assert _items(whole) == _items(last)
    text = "".join(PIECES[:max_output_tokens])
    reasoning, content, calls, _ = _read(text, "length")
    expected = [("reasoning", reasoning)] if reasoning else []
    expected += [("message", content or "")] if content or not calls else []
    expected += [("function_call", *call) for call in calls]
    assert [item[:-1] for item in _items(whole)] == expected  # all but the status
    if max_output_tokens == 40:
        assert whole.status == "completed" and whole.usage.output_tokens_details.reasoning_tokens
    # The streamed deltas add up to the items the last event carries.
    texts: dict[str, str] = {}
    for e in events:
        if e.type.endswith(".delta"):
            texts[e.item_id] = texts.get(e.item_id, "") + e.delta
    shown = [i.arguments if i.type == "function_call" else i.content[0].text for i in last.output]
    assert [texts.get(i.id, "") for i in last.output] == shown


@pytest.mark.slow
def test_history_and_reasoning_effort_reach_the_template(server, client) -> None:
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "call-1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
    ]  # fmt: skip
    ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": history}).json()["tokens"]
    prompt = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}).json()["prompt"]
    # (/detokenize leaves the special tokens out)
    assert "assistantanalysisLook it up.assistant to=functions.get_weathercommentary json" in prompt
    assert '{"city": "Paris"}functions.tool to=assistantcommentarysunnyassistant' in prompt
    # reasoning_effort is a variable the template reads (one it did not would be a 400).
    tokens = {e: _chat(client, reasoning_effort=e).usage.prompt_tokens for e in ("low", "high")}
    assert tokens["low"] != tokens["high"]
    answer = client.chat.completions.create(
        model="m", messages=history, temperature=0.0, max_tokens=40, tools=TOOLS
    ).choices[0]
    assert _whole(answer) == (REASONING, CONTENT, CALLS, "tool_calls")


@pytest.mark.slow
def test_an_output_constraint_is_refused_as_with_any_reasoning_split(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, tools=TOOLS, tool_choice="required")
    assert info.value.body["param"] == "tool_choice" and "harmony" in info.value.body["message"]

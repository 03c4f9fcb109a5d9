"""Structured outputs under attack, through a real `conveyor serve` and the openai SDK.

A client's constraint is a client's mistake when it cannot work: too big, unenforceable,
unsatisfiable, too slow to compile. Each is a 400 naming its field, and none of them holds up
another client's request. The "slow" schema is within every limit and still compiles in about
a second; the tests assert on the order responses come back in, not on how long they took,
except for bounds far above what the fixed server needs.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from tests.serve_process import start_server
from tests.structured.structured_schemas import slow_schema

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

MODEL = "demo"
ASK = [{"role": "user", "content": "Answer in JSON."}]


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}  # fmt: skip


def _serve(demo_model_dir, tmp_path_factory, *extra: str):
    args = ["--model", str(demo_model_dir), "--served-model-name", MODEL, "--num-kv-blocks", "256",
            *extra]  # fmt: skip
    return start_server(args, tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    # The time limit counts a check's wait too: the ordering tests below send "slow" schemas
    # (a second each) two at a time, which a loaded machine must not turn into timeouts.
    proc = _serve(demo_model_dir, tmp_path_factory, "--grammar-compile-timeout", "60")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


def _refused(client: openai.OpenAI, body: dict, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body,
                                       **kw)  # fmt: skip
    return refused.value.body


CIRCULAR = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
SELF_ALLOF = {"allOf": [{"$ref": "#"}]}
TOOL_SCHEMAS = {
    "banana": {"type": "banana"},
    "false-required": {"properties": {"x": False}, "required": ["x"]},
    "circular-ref": CIRCULAR,
    "self-allOf": SELF_ALLOF,
}


@pytest.mark.parametrize("mode", ["named", "required"])
@pytest.mark.parametrize("shape", list(TOOL_SCHEMAS))
def test_a_tool_schema_that_cannot_work_is_a_400_naming_tools(client, shape, mode) -> None:
    """Before: tool schemas were never checked before the engine: 500 (GrammarError)."""
    tools = [
        {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "f", "parameters": TOOL_SCHEMAS[shape]}},
    ]
    choice = {"type": "function", "function": {"name": "f"}} if mode == "named" else "required"
    body = _refused(client, {"tools": tools, "tool_choice": choice})
    assert body["param"] == "tools" and "tools[1].function.parameters" in body["message"]


CONSTRAINTS = [
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs", "never be satisfied"),
    (_schema(SELF_ALLOF), "response_format", "never be satisfied"),
    (_schema({"allOf": [{"type": "string"}, {"type": "integer"}]}), "response_format",
     "cannot be enforced"),
    (_schema({"$ref": "https://example.com/person.json"}), "response_format",
     "cannot be enforced"),
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
     "guided_json", "cannot be enforced"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "says"), CONSTRAINTS,
                         ids=["nothing-regex", "self-allOf", "allOf-types", "remote-ref",
                              "uniqueItems"])  # fmt: skip
def test_a_constraint_that_cannot_work_is_a_400_with_its_param(client, body, param, says) -> None:
    """Before: the first two were a 500 (GrammarRejectedError) and the others ran with the
    constraint silently dropped (`allOf: [string, integer]` gave an integer)."""
    refused = _refused(client, body)
    assert refused["param"] == param and says in refused["message"], refused


def test_a_dead_end_found_by_the_engine_is_a_400_naming_the_field(client, server) -> None:
    # "b" is an output, so the server's checks pass it; after "a" (all "b" is biased away
    # from) no character can follow: generating finds the dead end.
    tokenized = httpx.post(f"{server.base_url}/tokenize",
                           json={"prompt": "b", "add_special_tokens": False})  # fmt: skip
    ids = tokenized.json()["tokens"]
    body = {"guided_grammar": 'root ::= "a" x | "b"\nx ::= [^\\0-\\U0010ffff]',
            "logit_bias": {str(ids[0]): -100}}  # fmt: skip
    refused = _refused(client, body, temperature=1.0, seed=3)
    assert refused["param"] == "guided_grammar" and "never be satisfied" in refused["message"]
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, stream=True, extra_body=body
    )
    with pytest.raises(openai.APIError) as failed:
        for _ in stream:
            pass
    assert failed.value.body["code"] == 400 and failed.value.body["param"] == "guided_grammar"


def _optional(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


HUGE = {
    "5000-properties": _schema({**_optional(5000), "required": [f"p{i}" for i in range(5000)]}),
    "3000-optional": _schema(_optional(3000)),  # 82-138 s of compiling before
    "100k-choices": {"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}},
    "pattern-5000": _schema({"type": "string", "pattern": "[a-z]{1,5000}"}),
}


@pytest.mark.parametrize("name", list(HUGE))
def test_a_huge_constraint_is_refused_before_it_compiles(client, name) -> None:
    start = time.monotonic()
    refused = _refused(client, HUGE[name])
    assert "at most" in refused["message"] and refused["param"]
    assert time.monotonic() - start < 30  # a bound far above the ~0.1 s it takes


def test_chat_is_not_held_up_by_schema_checks(client, server) -> None:
    """Twenty 13 KB invalid schemas (each 2.5 s of CPU to refuse before) and a one-token
    chat request at once: the chat request took 48.6 s when they shared one pool."""
    pattern = {"type": "string", "pattern": "[a-z]{1,5000}"}
    bad = {"type": "object", "properties": {f"p{i}": pattern for i in range(200)},
           "required": ["p0"], "description": "x" * 4000,
           "unknown": {"type": "banana"}}  # fmt: skip
    assert len(json.dumps(bad)) > 13_000

    def attack(_: int) -> int:
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300,
                       json={"model": MODEL, "messages": ASK, **_schema(bad)})  # fmt: skip
        return r.status_code

    with ThreadPoolExecutor(21) as pool:
        attacks = [pool.submit(attack, i) for i in range(20)]
        time.sleep(0.2)  # the attack goes first
        start = time.monotonic()
        resp = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
        chat_s = time.monotonic() - start
        statuses = [a.result() for a in attacks]
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert statuses == [400] * 20
    assert chat_s < 10, chat_s


def _timed(fn, *args):
    fn(*args)
    return time.monotonic()


def test_a_small_regex_is_not_held_up_by_big_schemas(client) -> None:
    """Before: one compile thread, first come first served (a trivial regex waited 135 s)."""

    def big(tag: str) -> None:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       extra_body=_schema(slow_schema(tag)))  # fmt: skip

    def small() -> None:
        resp = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                              extra_body={"guided_regex": "[0-9]{2}w"})  # fmt: skip
        assert resp.choices[0].message.content in {f"{i:02d}w" for i in range(100)}

    with ThreadPoolExecutor(3) as pool:
        bigs = [pool.submit(_timed, big, f"small-{i}") for i in range(2)]
        time.sleep(0.3)  # both big ones are compiling or queued
        regex = pool.submit(_timed, small)
        assert regex.result() < min(b.result() for b in bigs)


def test_a_deadline_counts_while_waiting_for_a_grammar(client) -> None:
    """Before: a request with a 2 s deadline queued behind a compile ended after 45 s."""

    def big(tag: str, **extra) -> str | None:
        body = {**_schema(slow_schema(tag)), **extra}
        resp = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=2, extra_body=body
        )
        return resp.choices[0].finish_reason

    with ThreadPoolExecutor(3) as pool:
        ahead = [pool.submit(_timed, big, f"deadline-{i}") for i in range(2)]
        time.sleep(0.3)
        start = time.monotonic()
        late = pool.submit(lambda: (big("deadline-late", deadline=0.2), time.monotonic()))
        reason, ended = late.result()
        assert reason == "abort"
        assert ended < ahead[1].result()  # it did not wait for the compiles ahead of it
        assert ended - start < 30


@pytest.fixture(scope="module")
def strict_client(demo_model_dir, tmp_path_factory):
    proc = _serve(demo_model_dir, tmp_path_factory, "--grammar-compile-timeout", "0.5")
    yield openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0,
                        timeout=120)  # fmt: skip
    proc.stop()


def test_a_compile_past_the_time_limit_is_a_400_naming_the_limit(strict_client) -> None:
    refused = _refused(strict_client, _schema(slow_schema("strict")))
    assert refused["param"] == "response_format"
    assert "grammar_compile_timeout (0.5 s)" in refused["message"]
    # A small constraint still compiles in time, and plain requests are untouched.
    ok = strict_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, extra_body={"guided_regex": "[0-9]{2}w"}
    )
    assert ok.choices[0].finish_reason == "stop"

"""No silently ignored field: every field of the request models is honoured, an accepted
no-op hint, or refused with a 400 naming it; unknown routes and methods get OpenAI-shaped
errors naming them; GET /v1/models/{id}.

The audit tests need no server: they list every field of CompletionRequest and
ChatCompletionRequest (and every parameter the official `openai` SDK sends) and require each
to be classified here or in server/request_fields.py, so a new field cannot arrive unnoticed.
The rest runs against one real `conveyor serve` (the demo model, request templates trusted)
through the official client, vLLM's extras in extra_body.
"""

from __future__ import annotations

import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from tests.serve_process import start_server

from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.server.request_fields import CHAT_REFUSED, NO_OP_HINTS, REFUSED, TEMPLATE_FIELDS

# The fields that change the answer, per model (a new field must be added to one of the sets).
HONOURED_COMMON = {
    "model", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "priority",
    "deadline", "length_hint", "stream", "stream_options", "logit_bias", "best_of",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "prompt_logprobs", "cache_salt", "allowed_token_ids", "bad_words",
    "truncate_prompt_tokens",
}  # fmt: skip
HONOURED = {
    CompletionRequest: HONOURED_COMMON
    | {"prompt", "logprobs", "echo", "suffix", "add_special_tokens"},
    ChatCompletionRequest: HONOURED_COMMON
    | {
        "messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt",
        "chat_template", "chat_template_kwargs", "tools", "tool_choice", "functions",
        "function_call", "parallel_tool_calls",
    },
}  # fmt: skip
# OpenAI's own parameters of each endpoint, as the SDK declares them.
SDK_PARAMS = {
    CompletionRequest: completion_create_params.CompletionCreateParamsBase,
    ChatCompletionRequest: chat_create_params.CompletionCreateParamsBase,
}
# OpenAI's hints sit on chat completions; `user` on both.
_CHAT_ONLY_HINTS = NO_OP_HINTS - {"user"}


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_every_field_is_honoured_a_hint_or_refused(model) -> None:
    fields = set(model.model_fields)
    refused = set(REFUSED) | (set(CHAT_REFUSED) if model is ChatCompletionRequest else set())
    kinds = [HONOURED[model], NO_OP_HINTS, refused, set(TEMPLATE_FIELDS)]
    unclassified = fields - set().union(*kinds)
    assert not unclassified, f"classify these fields: {sorted(unclassified)}"
    for i, a in enumerate(kinds):
        for b in kinds[i + 1 :]:
            assert not (a & b & fields), f"fields in two kinds: {sorted(a & b & fields)}"
    missing = set(typing.get_type_hints(SDK_PARAMS[model])) - fields
    assert not missing, f"OpenAI parameters not declared (so silently ignored): {missing}"
    stale = set(REFUSED) | set(CHAT_REFUSED) | NO_OP_HINTS | set(TEMPLATE_FIELDS)
    declared = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert stale <= declared, f"classified but declared nowhere: {sorted(stale - declared)}"


# ---------------------------------------------------------------- against a real server

KEY = "sk-fields"
NAME, ALIAS = "org/tiny", "tiny-alias"  # a slash: /v1/models/{id} takes it


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-fields")
    args = ["--model", str(demo_model_dir), "--served-model-name", NAME, ALIAS]
    args += ["--api-key", KEY, "--num-kv-blocks", "160"]
    args += ["--max-num-seqs", "8", "--trust-request-chat-template"]
    proc = start_server(args, tmp)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


HI = [{"role": "user", "content": "Hi"}]


def _chat(client, **fields):
    extra = fields.pop("extra_body", None)
    fields = {"messages": HI, "max_tokens": 2, **fields}
    return client.chat.completions.create(model=NAME, extra_body=extra, **fields)


def _refused(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert error["param"] == param, error
    assert error["type"] == "BadRequestError"
    return error["message"]


# One value each that asks for something this server does not do.
REFUSED_VALUES = {
    "store": True,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "explicit"},
    "spaces_between_special_tokens": False,
    "logits_processors": ["mod.fn"],
    "return_tokens_as_token_ids": True,
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ",
    "structural_tag": "{}",
    "continue_final_message": True,
    "return_token_ids": True,
    "kv_transfer_params": {"do_remote_prefill": True},
    "vllm_xargs": {"a": 1},
    "mm_processor_kwargs": {"fps": 1},
    "echo": True,
    "add_special_tokens": True,
    "documents": [{"title": "t", "text": "x"}],
}


def test_every_refused_field_has_a_refused_value_here() -> None:
    assert set(REFUSED_VALUES) == set(REFUSED) | set(CHAT_REFUSED)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_refused_fields_are_a_400_naming_them(client, name) -> None:
    message = _refused(lambda: _chat(client, extra_body={name: REFUSED_VALUES[name]}), name)
    assert message.startswith(f"{name}=")
    if name in REFUSED and name in CompletionRequest.model_fields:  # both endpoints have it
        body = {name: REFUSED_VALUES[name]}
        call = lambda: client.completions.create(model=NAME, prompt="x", extra_body=body)  # noqa: E731
        _refused(call, name)


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses", "embeddings"])
def test_an_unknown_field_is_a_400_naming_it(client, endpoint) -> None:
    body = {"top_kk": 3}  # a typo of vLLM's top_k: ignoring it would change nothing silently
    calls = {
        "completions": lambda: client.completions.create(model=NAME, prompt="x", extra_body=body),
        "chat": lambda: _chat(client, extra_body=body),
        "responses": lambda: client.responses.create(model=NAME, input="x", extra_body=body),
        "embeddings": lambda: client.embeddings.create(model=NAME, input="x", extra_body=body),
    }
    assert "unrecognized request argument" in _refused(calls[endpoint], "top_kk")


@pytest.mark.slow
def test_values_that_ask_for_nothing_are_accepted(client) -> None:
    fine = {
        "store": False, "use_beam_search": False, "length_penalty": 1.0, "modalities": ["text"],
        "prompt_cache_retention": "in_memory", "prompt_cache_options": {"mode": "implicit"},
        "parallel_tool_calls": True, "spaces_between_special_tokens": True,
        "return_tokens_as_token_ids": False, "continue_final_message": False,
        "return_token_ids": False, "echo": False, "add_special_tokens": False,
    }  # fmt: skip
    assert _chat(client, extra_body=fine).choices[0].finish_reason == "length"


@pytest.mark.slow
def test_hints_are_accepted_and_type_checked(client, http) -> None:
    hints = {
        "user": "u-1", "metadata": {"team": "a"}, "service_tier": "flex",
        "prompt_cache_key": "k", "safety_identifier": "s-1",
    }  # fmt: skip
    assert set(hints) == NO_OP_HINTS
    assert _chat(client, **hints).choices[0].finish_reason == "length"
    client.completions.create(model=NAME, prompt="x", max_tokens=1, user="u-1")
    bad = {
        "user": 5, "metadata": {"a": 1}, "service_tier": "gold", "prompt_cache_key": ["k"],
        "safety_identifier": {},
    }  # fmt: skip
    for name, value in bad.items():
        r = http.post("/v1/chat/completions", json={"messages": HI, name: value})
        assert (r.status_code, r.json()["error"]["param"]) == (400, name), r.text
    many = {f"k{i}": "v" for i in range(17)}
    r = http.post("/v1/chat/completions", json={"messages": HI, "metadata": many})
    assert r.status_code == 400 and "at most 16 pairs" in r.json()["error"]["message"]
    for name in _CHAT_ONLY_HINTS:
        assert name not in CompletionRequest.model_fields  # OpenAI's completions lack them


# Renders a long system line only for high effort: the prompt grows when the field arrives.
EFFORT_TEMPLATE = (
    "{% if reasoning_effort == 'high' %}Think very hard and carefully first. {% endif %}"
    "{% if verbosity == 'low' %}Be brief. {% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)


@pytest.mark.slow
def test_reasoning_effort_and_verbosity_reach_templates_that_read_them(client) -> None:
    for name, value in (("reasoning_effort", "high"), ("verbosity", "low")):
        message = _refused(lambda n=name, v=value: _chat(client, **{n: v}), name)
        assert "does not read" in message  # the demo's template has neither
    _refused(lambda: _chat(client, extra_body={"reasoning_effort": "banana"}), "reasoning_effort")
    _refused(lambda: _chat(client, extra_body={"verbosity": "loud"}), "verbosity")
    own = {"chat_template": EFFORT_TEMPLATE}
    plain = _chat(client, extra_body=own).usage.prompt_tokens
    high = _chat(client, reasoning_effort="high", extra_body=own).usage.prompt_tokens
    low = _chat(client, reasoning_effort="low", extra_body=own).usage.prompt_tokens
    brief = _chat(client, verbosity="low", extra_body=own).usage.prompt_tokens
    assert high > plain == low < brief
    both = {**own, "chat_template_kwargs": {"reasoning_effort": "low"}}
    _refused(lambda: _chat(client, reasoning_effort="high", extra_body=both), "reasoning_effort")


def _ids(http, text: str) -> list[int]:
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    return r.json()["tokens"]


def _text(http, ids: list[int]) -> str:
    return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


@pytest.mark.slow
def test_allowed_token_ids_and_bad_words_mask_the_output(client, http) -> None:
    # Two words of one token each: the output can only repeat them.
    (a,), (b,) = _ids(http, "the"), _ids(http, " and")
    word_a, word_b = _text(http, [a]), _text(http, [b])

    def run(**extra):
        extra = {"allowed_token_ids": [a, b], "ignore_eos": True, **extra}
        out = client.completions.create(
            model=NAME, prompt="The", max_tokens=4, temperature=0, extra_body=extra
        )
        return out.choices[0].text

    assert set(run().replace(word_a, "").replace(word_b, "")) == set()
    assert run(logit_bias={str(a): 100}) == word_a * 4
    # A bad word beats a +100 bias: what is left is the other allowed token.
    assert run(logit_bias={str(a): 100}, bad_words=["the"]) == word_b * 4
    chat = _chat(client, max_tokens=3, extra_body={"allowed_token_ids": [b], "ignore_eos": True})
    assert chat.choices[0].message.content == word_b * 3
    vocab_error = {"allowed_token_ids": [10**6]}
    _refused(lambda: _chat(client, extra_body=vocab_error), "allowed_token_ids")
    _refused(lambda: _chat(client, extra_body={"bad_words": [""]}), "bad_words")


@pytest.mark.slow
def test_truncate_prompt_tokens_keeps_the_last_tokens(client, http) -> None:
    prompt = "The quick brown fox jumps over the lazy dog and keeps on running"
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    out = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=1, echo=True,
        extra_body={"truncate_prompt_tokens": 5},
    )  # fmt: skip
    assert out.usage.prompt_tokens == 5 < len(ids)
    assert out.choices[0].text.startswith(_text(http, ids[-5:]))
    full = _chat(client, messages=[{"role": "user", "content": prompt}]).usage.prompt_tokens
    cut = _chat(
        client, messages=[{"role": "user", "content": prompt}],
        extra_body={"truncate_prompt_tokens": 7},
    )  # fmt: skip
    assert cut.usage.prompt_tokens == 7 < full
    for bad in (0, -2, 10**6):
        call = lambda v=bad: _chat(client, extra_body={"truncate_prompt_tokens": v})  # noqa: E731
        _refused(call, "truncate_prompt_tokens")
    # -1: as much as the context holds, so a prompt that fits is kept whole.
    kept = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": -1}
    )
    assert kept.usage.prompt_tokens == len(ids)
    # vLLM's add_special_tokens on completions: tokenized as /tokenize does with the same flag.
    plain = len(_ids(http, prompt))
    out = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=1, extra_body={"add_special_tokens": False}
    )
    assert out.usage.prompt_tokens == plain


@pytest.mark.slow
def test_cache_salt_is_honoured_on_chat(client) -> None:
    text = "Tell me everything about the long history of the quick brown fox. " * 4
    messages = [{"role": "user", "content": text}]

    def cached(salt: str) -> int:
        out = _chat(client, messages=messages, extra_body={"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens

    cached("salt-a")
    assert cached("salt-a") > 0  # the same salt shares the prefix
    assert cached("salt-b") == 0  # another salt shares nothing


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_non_text_content_parts_are_a_clean_400(http, kind) -> None:
    part = {"type": kind, kind: {"url": "data:,x"}}
    content = [{"type": "text", "text": "what is this?"}, part]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (400, "messages")
    assert f"content[1] is a '{kind}' part" in error["message"]
    assert "Input should be" not in error["message"]  # not pydantic's union of mismatches


@pytest.mark.slow
def test_unknown_routes_and_methods_are_openai_errors_naming_them(http) -> None:
    r = http.post("/v1/nowhere", json={})
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": "Invalid URL (POST /v1/nowhere): this server has no such route.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    error = r.json()["error"]
    assert error["type"] == "MethodNotAllowedError" and error["code"] == 405
    assert "GET /v1/chat/completions" in error["message"] and "POST" in error["message"]


@pytest.mark.slow
def test_models_retrieve_takes_every_served_name(client, http) -> None:
    for name in (NAME, ALIAS):
        card = client.models.retrieve(name)
        assert (card.id, card.object, card.owned_by) == (name, "model", "conveyor")
    assert http.get(f"/v1/models/{NAME}").json()["id"] == NAME  # the slash unescaped too
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["param"] == "model"
    assert NAME in info.value.body["message"]

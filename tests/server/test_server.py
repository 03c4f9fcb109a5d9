"""A real `conveyor serve` (uvicorn subprocess) with the demo model, driven by the official
`openai` SDK and by httpx: responses, streams, concurrency, disconnects and metrics."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from tests.serve_process import metric_value, start_server

from conveyor import LLM, SamplingParams

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

MODEL = "demo"
PROMPTS = ["The quick brown fox", "def add(a, b):", "Hello, world"]


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    args = ["--model", str(demo_model_dir), "--served-model-name", MODEL]
    proc = start_server([*args, "--num-kv-blocks", "256"], tmp_path_factory.mktemp("serve"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def greedy(demo_model_dir) -> list[str]:
    """What LLM.generate makes of PROMPTS, greedy, 12 tokens."""
    llm = LLM(str(demo_model_dir), num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _sse_events(response: httpx.Response) -> list[str]:
    """Payloads of an SSE body, checking the framing: `data: ...` events split by blank lines."""
    body = response.read().decode()
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-2]  # the rest: "data: [DONE]", ""
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e[len("data: ") :] for e in events]


def _metrics(server) -> str:
    return httpx.get(f"{server.base_url}/metrics").text


def test_greedy_completion_text_equals_llm_generate(client, greedy) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == greedy
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 36
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 36


def test_streamed_completion_concatenates_to_the_same_text(client, greedy) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == greedy[0]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)  # no usage unless include_usage


def test_chat_completion_and_its_stream_agree(client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    kwargs = dict(model=MODEL, messages=messages, temperature=0, max_completion_tokens=10)
    resp = client.chat.completions.create(**kwargs)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 10

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_n_2_returns_two_indexed_choices(client) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="Once upon a time", n=2, max_tokens=6, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == 12
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], n=2, max_tokens=4, seed=1,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(chat)
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices}
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 8


def test_stop_string_cuts_the_text_before_it(client, greedy) -> None:
    full = greedy[0]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip() and stop in full
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = resp.choices[0]
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_completion_logprobs_have_vllm_shape(client, greedy) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == resp.choices[0].text == greedy[1]
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 4
        assert top[token] == value == max(top.values())  # greedy picks the most likely


def test_chat_logprobs_list_top_alternatives(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob


def test_streamed_completion_logprobs_concatenate_to_the_non_streamed_ones(client) -> None:
    kwargs = dict(
        model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert all(c.logprobs is not None and c.logprobs.tokens is not None for c in chunks)
    streamed = {
        field: [v for c in chunks for v in getattr(c.logprobs, field)]
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert len(whole.tokens) == 12
    assert streamed == {field: getattr(whole, field) for field in streamed}
    for c in chunks:  # each chunk's logprobs describe exactly its own text
        assert "".join(c.logprobs.tokens) == c.text


def test_streamed_chat_logprobs_concatenate_to_the_non_streamed_ones(client) -> None:
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True)]
    assert chunks[0].logprobs is None  # the role chunk comes before any token
    streamed = [t for c in chunks[1:] for t in c.logprobs.content]
    assert len(whole) == 8
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in whole]


def test_developer_role_renders_as_system(server, client) -> None:
    def chat(role: str) -> list[dict[str, str]]:
        return [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi!"}]

    url = f"{server.base_url}/tokenize"
    as_system = httpx.post(url, json={"messages": chat("system")}).json()["tokens"]
    as_developer = httpx.post(url, json={"messages": chat("developer")}).json()["tokens"]
    assert as_developer == as_system
    kwargs = dict(model=MODEL, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    system = client.chat.completions.create(messages=chat("system"), **kwargs)
    developer = client.chat.completions.create(messages=chat("developer"), **kwargs)
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens == len(as_system)
    assert developer.choices[0].message.content == system.choices[0].message.content


def test_include_usage_adds_one_final_chunk_with_empty_choices(server) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "stream": True, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(e) for e in _sse_events(r)]
    assert [e["choices"] for e in events[-1:]] == [[]]
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert all("usage" not in e for e in events[:-1])


def test_echo_prepends_the_prompt(client, greedy) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.choices[0].text == PROMPTS[2] + greedy[2]
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, echo=True, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in stream) == PROMPTS[2] + greedy[2]


def test_64_concurrent_streams_all_complete(server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request number {i}:", max_tokens=8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish, usage = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return i, finish, usage

    async def run() -> list[tuple[int, str | None, int]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="x", max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    assert sorted(results) == [(i, "length", 8) for i in range(64)]


def test_client_disconnect_aborts_and_frees_kv_blocks(server) -> None:
    url = server.base_url
    aborted = metric_value(
        _metrics(server), "conveyor:request_success_total", finished_reason="abort"
    )
    body = {"prompt": "Go on forever", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        text = _metrics(server)
        assert metric_value(text, "conveyor:kv_cache_usage_perc") > 0
        assert metric_value(text, "conveyor:num_requests_running") == 1
    deadline = time.monotonic() + 10
    while metric_value(_metrics(server), "conveyor:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "KV blocks were not freed after the disconnect"
        time.sleep(0.05)
    text = _metrics(server)
    assert metric_value(text, "conveyor:num_requests_running") == 0
    assert metric_value(text, "conveyor:request_success_total", finished_reason="abort") == (
        aborted + 1
    )


def test_generation_tokens_total_counts_every_returned_token(server, client) -> None:
    before = _metrics(server)
    returned = prompt = 0
    for i, max_tokens in enumerate([3, 7, 11]):
        resp = client.completions.create(model=MODEL, prompt=f"Count {i}", max_tokens=max_tokens)
        returned += resp.usage.completion_tokens
        prompt += resp.usage.prompt_tokens
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=9, n=2
    )
    returned += chat.usage.completion_tokens
    prompt += chat.usage.prompt_tokens
    stream = client.completions.create(
        model=MODEL, prompt="Stream", max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    usage = [c.usage for c in stream if c.usage][-1]
    returned += usage.completion_tokens
    prompt += usage.prompt_tokens
    after = _metrics(server)

    def delta(name: str) -> float:
        return metric_value(after, name, model_name=MODEL) - metric_value(before, name)

    assert delta("conveyor:generation_tokens_total") == returned
    assert delta("conveyor:prompt_tokens_total") == prompt
    assert delta("conveyor:e2e_request_latency_seconds_count") == 5
    assert delta("conveyor:time_to_first_token_seconds_count") == 5
    for name in (
        "conveyor:num_requests_running", "conveyor:num_requests_waiting",
        "conveyor:kv_cache_usage_perc", "conveyor:time_to_first_token_seconds_bucket",
        "conveyor:inter_token_latency_seconds_bucket", "conveyor:e2e_request_latency_seconds_sum",
        "conveyor:request_queue_time_seconds_count", "conveyor:num_preemptions_total",
        "conveyor:request_success_total", "conveyor:iteration_tokens_total_bucket",
    ):  # fmt: skip
        assert f"{name}{{" in after and f'model_name="{MODEL}"' in after, name


def test_models_health_version_tokenize_detokenize(server, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    url = server.base_url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]
    tok = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 2048
    text = httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert httpx.post(f"{url}/tokenize", json=chat).json()["count"] > tok["count"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_http_process_never_loads_torch(server, client) -> None:
    """After plain completions and chats, the server process (not its engine process) has
    mapped no torch library: the tokenizer of an HF folder loads without it. (A structured
    output's check imports xgrammar, which imports torch: no test of this module sends one.)"""
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps


def test_a_repeated_prefix_is_reported_as_cached_tokens(client, server) -> None:
    system = {"role": "system", "content": "You answer in one short sentence, kindly. " * 4}
    ask = [system, {"role": "user", "content": "What is the sea?"}]
    before = _metrics(server)
    first = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4)
    # A new question after the same system prompt; then the whole first exchange again.
    again = [system, {"role": "user", "content": "What is the sky?"}]
    second = client.chat.completions.create(model=MODEL, messages=again, max_tokens=4)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0
    assert first.usage.prompt_tokens_details.cached_tokens >= 0
    # Streamed: the final usage chunk carries it too; completions report it the same way.
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ask, max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
    prompt = "Once upon a time, in a land far away, there lived a very old and wise owl."
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    resp = client.completions.create(model=MODEL, prompt=prompt + " It", max_tokens=2)
    assert resp.usage.prompt_tokens_details.cached_tokens >= 16
    after = _metrics(server)
    queries = metric_value(after, "conveyor:prefix_cache_queries_total") - metric_value(
        before, "conveyor:prefix_cache_queries_total"
    )
    hits = metric_value(after, "conveyor:prefix_cache_hits_total") - metric_value(
        before, "conveyor:prefix_cache_hits_total"
    )
    assert queries >= sum(r.usage.prompt_tokens for r in (first, second, resp))
    assert hits >= cached + 16

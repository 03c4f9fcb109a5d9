"""Bad requests get the right 4xx and OpenAI's error body; the server keeps serving after them.

The server runs without --model (the embedded demo model, from a prepared cache folder), with
its settings from a YAML file that flags override, and with an API key.
"""

from __future__ import annotations

import shutil
import sys

import httpx
import openai
import pytest
from tests.serve_process import start_server

from conveyor import LLM, SamplingParams
from conveyor.core.limits import PromptLimits
from conveyor.model.loading import demo

pytestmark = pytest.mark.slow  # each test talks to a real `conveyor serve`

KEY = "sk-test-key"
NAME = "tiny"
ALIAS = "tiny-alias"  # a second served name: accepted in requests, never reported
OK_MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-errors")
    # The folder demo_model_path() looks for, so serving without --model needs no build.
    version = f"py{sys.version_info[0]}{sys.version_info[1]}"
    cached = tmp / "cache" / f"demo-llama-v{demo.DEMO_RECIPE_VERSION}-{version}"
    shutil.copytree(demo_model_dir, cached)
    config = tmp / "serve.yaml"
    # port 1 would fail to bind: the --port flag the helper passes must win over the file.
    config.write_text(
        f"served-model-name: [{NAME}, {ALIAS}]\napi_key: {KEY}\nport: 1\nnum_kv_blocks: 160\n"
        "max_num_seqs: 8\n"
    )
    env = {"CONVEYOR_CACHE_DIR": str(tmp / "cache")}
    proc = start_server(["--config", str(config)], tmp, env=env)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


LONG_PROMPT = "hello world " * 2100  # > 2048 tokens

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def _p(**fields: object) -> dict[str, object]:
    """A completions body with a fine prompt plus `fields`."""
    return {"prompt": "x", **fields}


def _m(**fields: object) -> dict[str, object]:
    """A chat body with fine messages plus `fields`."""
    return {"messages": OK_MESSAGES, **fields}


# (name, path, JSON body or raw bytes, expected status, expected param)
BAD_REQUESTS = [
    ("max_tokens wrong type", CMPL, _p(max_tokens="ten"), 400, "max_tokens"),
    ("max_tokens bool", CMPL, _p(max_tokens=True), 400, "max_tokens"),
    ("max_tokens zero", CMPL, _p(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", CMPL, _p(max_tokens=-3), 400, "max_tokens"),
    ("huge max_tokens", CMPL, _p(max_tokens=10**9), 400, "max_tokens"),
    ("temperature negative", CMPL, _p(temperature=-0.5), 400, "temperature"),
    ("temperature string", CMPL, _p(temperature="hot"), 400, "temperature"),
    ("top_p zero", CMPL, _p(top_p=0), 400, "top_p"),
    ("top_k below -1", CMPL, _p(top_k=-2), 400, "top_k"),
    ("min_p above 1", CMPL, _p(min_p=1.5), 400, "min_p"),
    ("n zero", CMPL, _p(n=0), 400, "n"),
    ("presence_penalty", CMPL, _p(presence_penalty=3), 400, "presence_penalty"),
    ("repetition_penalty", CMPL, _p(repetition_penalty=0), 400, "repetition_penalty"),
    ("logprobs too many", CMPL, _p(logprobs=21), 400, "logprobs"),
    ("empty stop string", CMPL, _p(stop=[""]), 400, "stop"),
    ("stop wrong type", CMPL, _p(stop=5), 400, "stop"),
    ("negative stop token", CMPL, _p(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("min_tokens above max", CMPL, _p(max_tokens=2, min_tokens=5), 400, "min_tokens"),
    ("seed string", CMPL, _p(seed="42"), 400, "seed"),
    ("empty prompt list", CMPL, {"prompt": []}, 400, "prompt"),
    ("empty prompt", CMPL, {"prompt": ""}, 400, "prompt"),
    ("empty token prompt", CMPL, {"prompt": [[]]}, 400, "prompt"),
    ("mixed prompt list", CMPL, {"prompt": [1, "a"]}, 400, "prompt"),
    ("token id out of vocab", CMPL, {"prompt": [1, 10**6]}, 400, "prompt"),
    ("missing prompt", CMPL, {"max_tokens": 3}, 400, "prompt"),
    ("prompt too long", CMPL, {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    ("unknown model", CMPL, _p(model="gpt-4"), 404, "model"),
    ("stream_options without stream", CMPL, _p(stream_options={}), 400, "stream_options"),
    ("echo with logprobs, streamed", CMPL, _p(echo=True, logprobs=1, stream=True), 400, "echo"),
    ("malformed JSON", CMPL, b'{"prompt": "x",', 400, None),
    ("body not an object", CMPL, [1, 2], 400, None),
    ("body not JSON", CMPL, b"prompt=x", 400, None),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    ("message without role", CHAT, {"messages": [{"content": "x"}]}, 400, "messages"),
    ("content wrong type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("top_logprobs without logprobs", CHAT, _m(top_logprobs=2), 400, "top_logprobs"),
    ("top_logprobs too many", CHAT, _m(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("max_completion_tokens huge", CHAT, _m(max_completion_tokens=5000), 400, "max_tokens"),
    ("chat unknown model", CHAT, _m(model="nope"), 404, "model"),
    (
        "chat too long",
        CHAT,
        {"messages": [{"role": "user", "content": LONG_PROMPT}]},
        400,
        "messages",
    ),
    ("detokenize bad id", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("deadline negative", CMPL, _p(deadline=-1), 400, "deadline"),
    ("deadline zero", CMPL, _p(deadline=0), 400, "deadline"),
    ("deadline string", CMPL, _p(deadline="soon"), 400, "deadline"),
    ("chat deadline negative", CHAT, _m(deadline=-0.5), 400, "deadline"),
    ("length_hint zero", CMPL, _p(length_hint=0), 400, "length_hint"),
    ("length_hint float", CHAT, _m(length_hint=1.5), 400, "length_hint"),
    ("priority out of range", CMPL, _p(priority=2**40), 400, "priority"),
    ("priority string", CHAT, _m(priority="high"), 400, "priority"),
    ("n above the cap", CMPL, _p(n=17), 400, "n"),
    ("unknown route", "/v1/rerank", {"input": "x"}, 404, None),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_request_gets_4xx_with_error_body(http, path, body, status, param) -> None:
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert error["message"] and "Traceback" not in error["message"]


def test_context_errors_say_the_maximum_context_length(http) -> None:
    for body in ({"prompt": "x", "max_tokens": 10**9}, {"prompt": LONG_PROMPT}):
        message = http.post("/v1/completions", json=body).json()["error"]["message"]
        assert message.startswith("This model's maximum context length is 2048 tokens.")


def test_the_three_fit_checks_give_one_message(http, demo_model_dir) -> None:
    # The same too-long prompt through HTTP, LLM.generate and PromptLimits (core/limits.py).
    prompt = [5] * 2100
    body = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    llm = LLM(str(demo_model_dir), num_kv_blocks=160)  # the server's settings
    with pytest.raises(ValueError) as from_llm:
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    limits = PromptLimits(2048, demo.DEMO_CONFIG["vocab_size"], 160 * 16)
    with pytest.raises(ValueError) as direct:
        limits.check(prompt, SamplingParams(max_tokens=1))
    message = body["error"]["message"]
    assert message == str(from_llm.value) == str(direct.value)
    assert message.startswith("This model's maximum context length is 2048 tokens.")


def test_wrong_method_is_405(http) -> None:
    assert http.get("/v1/completions").status_code == 405


def test_requests_still_succeed_after_the_bad_ones(server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    resp = client.completions.create(model=NAME, prompt="Still alive?", max_tokens=4)
    assert resp.usage.completion_tokens >= 1
    chat = client.chat.completions.create(model=NAME, messages=OK_MESSAGES, max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("header", [None, "Bearer wrong", KEY, f"Basic {KEY}"])
def test_missing_or_wrong_api_key_is_401(server, header) -> None:
    headers = {"Authorization": header} if header else {}
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
        url = f"{server.base_url}{path}"
        resp = httpx.request(method, url, headers=headers, json={"prompt": "x"})
        assert resp.status_code == 401
        assert resp.json()["error"]["type"] == "AuthenticationError"


def test_sdk_with_wrong_key_raises_authentication_error(server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_health_version_and_metrics_need_no_key(server) -> None:
    url = server.base_url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").status_code == 200
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.status_code == 200 and f'model_name="{NAME}"' in metrics.text


def test_an_alias_is_accepted_listed_and_the_first_name_reported(http) -> None:
    assert [card["id"] for card in http.get("/v1/models").json()["data"]] == [NAME, ALIAS]
    resp = http.post("/v1/completions", json={"model": ALIAS, "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["model"] == NAME
    tokens = http.post("/tokenize", json={"model": ALIAS, "prompt": "x"})
    assert tokens.status_code == 200


def test_unknown_model_404_lists_the_served_names(http) -> None:
    for path, body in ((CMPL, _p(model="gpt-4")), (CHAT, _m(model="gpt-4"))):
        error = http.post(path, json=body).json()["error"]
        assert error["message"] == (
            f"The model `gpt-4` does not exist. This server serves: `{NAME}`, `{ALIAS}`."
        )


def test_served_without_model_flag_it_is_the_demo_model(http) -> None:
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == NAME
    assert card["root"].endswith(
        f"demo-llama-v{demo.DEMO_RECIPE_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}"
    )

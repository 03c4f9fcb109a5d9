"""logit_bias (OpenAI's semantics: sampler, checks, server) and prompt logprobs through the
server (their engine side: tests/model/test_prompt_logprobs.py)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from tests.model.test_sampler import random_logits, req
from tests.serve_process import start_server

from conveyor.model.sampling.sampler import Sampler
from conveyor.sampling_params import SamplingParams

MODEL = "demo"


def test_bias_is_added_to_its_row_only_and_logprobs_stay_raw() -> None:
    logits = random_logits(3, 50)
    worst = int(logits[1].argmin())
    rows = [req(temperature=0.0), req(temperature=0.0, logit_bias={worst: 100.0}, logprobs=1),
            req(temperature=0.0)]  # fmt: skip
    out = Sampler(50)(logits, rows)
    assert out.token_ids == [int(logits[0].argmax()), worst, int(logits[2].argmax())]
    raw = logits[1].log_softmax(-1)[worst]
    assert out.logprobs[1].logprob == pytest.approx(float(raw), abs=1e-5)


def test_minus_100_bans_a_token_even_when_sampling() -> None:
    logits = torch.zeros(1, 4)
    logits[0, 2] = 30.0  # all but certain without the bias
    for seed in range(20):
        params = dict(temperature=1.0, seed=seed, logit_bias={2: -100})
        assert Sampler(4)(logits, [req(**params)]).token_ids != [2]


@pytest.mark.parametrize(
    "bias", [{1: 101}, {1: -100.5}, {-1: 1}, {"1": 1}, {1: float("nan")}, {1: True}, [1]]
)
def test_bad_logit_bias_is_a_value_error_naming_it(bias) -> None:
    with pytest.raises(ValueError, match=r"^logit_bias"):
        SamplingParams(logit_bias=bias)


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    args = ["--model", str(demo_model_dir), "--served-model-name", MODEL, "--num-kv-blocks", "64"]
    proc = start_server(args, tmp_path_factory.mktemp("serve"))
    yield proc
    proc.stop()


@pytest.mark.slow
def test_logit_bias_through_the_server(server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

    def tokens(text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        return httpx.post(f"{server.base_url}/tokenize", json=body).json()["tokens"]

    plain = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0.0, logprobs=0
    )
    first = plain.choices[0].logprobs.tokens[0]
    token_id = tokens(first)[0]
    banned = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0.0,
        logit_bias={str(token_id): -100}, logprobs=0,
    )  # fmt: skip
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=1.0, logit_bias={"42": 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert set(tokens(forced.choices[0].message.content)) == {42}
    for bias, why in (({"9999999": 1}, "[0, "), ({"5": 101}, "[-100, 100]"), ({"x": 1}, "keys")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="Hello", logit_bias=bias)
        assert refused.value.body["param"] == "logit_bias"
        assert why in refused.value.body["message"]


@pytest.mark.slow
def test_echo_with_logprobs_leads_with_the_prompt_tokens(server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    prompt = "def add(a, b):"
    body = {"prompt": prompt, "add_special_tokens": False}
    prompt_ids = httpx.post(f"{server.base_url}/tokenize", json=body).json()["tokens"]
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0.0, echo=True, logprobs=2,
        extra_body={"prompt_logprobs": 2, "ignore_eos": True},
    )  # fmt: skip
    choice = resp.choices[0]
    lp = choice.logprobs
    n = len(prompt_ids)
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == n + 3 and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n] == len(prompt)
    vllm = choice.model_extra["prompt_logprobs"]
    assert len(vllm) == n and vllm[0] is None
    for p in range(1, n):
        entry = vllm[p][str(prompt_ids[p])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[p])
        assert len(vllm[p]) <= 3 and entry["rank"] >= 1
    assert resp.usage.prompt_tokens == n


@pytest.mark.slow
def test_prompt_logprobs_are_refused_where_they_are_not_computed(server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", echo=True, logprobs=1, stream=True)
    assert refused.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}],
            extra_body={"prompt_logprobs": 1},
        )  # fmt: skip
    assert refused.value.body["param"] == "prompt_logprobs"

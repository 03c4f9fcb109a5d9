"""Embeddings: LLM.embed and POST /v1/embeddings against transformers' final hidden states.

Tiny random-weight checkpoints in float32 (tests/hf_checkpoints.py); the reference is
`AutoModel(...).last_hidden_state` (after the final norm) pooled and L2-normalized. Prompts run
in chunks of 16 tokens (max_num_batched_tokens), so a long one spans several steps and mean
pooling accumulates over chunks.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
import threading
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers
from tests.hf_checkpoints import write_checkpoint
from tests.serve_process import metric_value, start_server

from conveyor import LLM, PoolingParams, SamplingParams
from conveyor.config import EngineConfig
from conveyor.model.loading.pooling_config import read_pooling_config
from conveyor.server.config import build_serve_config

TOL = 2e-5
CHUNK = 16  # max_num_batched_tokens: prompts longer than this span several steps
LONG = list(range(3, 3 + 90))  # six chunks


def _write_st_pooling(path: Path, mode: str) -> None:
    """A sentence-transformers layout, as Qwen3-Embedding ships it."""
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken")  # fmt: skip
    flags = {f"pooling_mode_{m}": m == mode for m in modes}
    pooling = {"word_embedding_dimension": 64, **flags}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


@pytest.fixture(scope="module")
def checkpoints(tiny_tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embed-ckpts")
    out = {f: write_checkpoint(root / f, f, tiny_tokenizer_dir) for f in ("llama", "qwen2")}
    # Mean pooling declared the sentence-transformers way; Matryoshka declared in config.json.
    mean = root / "qwen2-st-mean"
    shutil.copytree(out["qwen2"], mean)
    _write_st_pooling(mean, "mean_tokens")
    cfg = json.loads((mean / "config.json").read_text())
    (mean / "config.json").write_text(json.dumps({**cfg, "is_matryoshka": True}))
    out["st-mean"] = mean
    last = root / "llama-st-last"
    shutil.copytree(out["llama"], last)
    _write_st_pooling(last, "lasttoken")
    out["st-last"] = last
    return out


def _reference(path: Path, prompts: list[list[int]], pooling: str, dims: int | None = None):
    hf = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
    vectors = []
    with torch.no_grad():
        for ids in prompts:
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]
            vec = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            vectors.append(F.normalize(vec[:dims], dim=0))
    return vectors


def _close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        g = torch.tensor(g)
        assert torch.allclose(g, w, atol=TOL, rtol=0), (g - w).abs().max()


PROMPTS = [[5, 6, 7], LONG, list(range(40, 57)), [9]]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_last_and_mean_pooling_match_transformers_across_chunks(checkpoints, family) -> None:
    path = checkpoints[family]
    with LLM(str(path), max_num_batched_tokens=CHUNK, num_kv_blocks=64) as llm:
        for pooling in ("last", "mean"):
            outs = llm.embed(PROMPTS, PoolingParams(pooling_type=pooling), use_tqdm=False)
            _close([o.outputs.embedding for o in outs], _reference(path, PROMPTS, pooling))
            assert [o.prompt_token_ids for o in outs] == PROMPTS
        # The default for a decoder without a sentence-transformers config: the last token.
        default = llm.embed(PROMPTS[:2], use_tqdm=False)
        _close([o.outputs.embedding for o in default], _reference(path, PROMPTS[:2], "last"))
        # Blocks are freed: nothing is left running or holding the cache.
        metrics = {m.name: m.value for m in llm.get_metrics()}
        assert metrics["conveyor:kv_cache_usage_perc"] == 0.0
        assert metrics["conveyor:num_requests_running"] == 0.0


def test_sentence_transformers_config_and_matryoshka_dimensions(checkpoints) -> None:
    path = checkpoints["st-mean"]
    assert read_pooling_config(path, 64).pooling_type == "mean"
    assert read_pooling_config(checkpoints["st-last"], 64).pooling_type == "last"
    assert read_pooling_config(checkpoints["qwen2"], 64).source == "default"
    with LLM(str(path), max_num_batched_tokens=CHUNK, num_kv_blocks=64) as llm:
        outs = llm.embed(PROMPTS, use_tqdm=False)  # the checkpoint's mean pooling
        _close([o.outputs.embedding for o in outs], _reference(path, PROMPTS, "mean"))
        short = llm.embed(PROMPTS[:2], PoolingParams(dimensions=16), use_tqdm=False)
        assert [len(o.outputs.embedding) for o in short] == [16, 16]
        _close([o.outputs.embedding for o in short], _reference(path, PROMPTS[:2], "mean", 16))
        with pytest.raises(ValueError, match=r"dimensions must be in \[1, 64\]"):
            llm.embed(PROMPTS[:1], PoolingParams(dimensions=65), use_tqdm=False)
    # The engine's pooling_type overrides the checkpoint's.
    with LLM(str(path), max_num_batched_tokens=CHUNK, num_kv_blocks=64, pooling_type="last") as llm:
        outs = llm.embed(PROMPTS[:2], use_tqdm=False)
        _close([o.outputs.embedding for o in outs], _reference(path, PROMPTS[:2], "last"))


def test_a_bare_decoder_checkpoint_saved_from_automodel_loads(checkpoints, tmp_path) -> None:
    """Embedding checkpoints are often a bare decoder (`Qwen2Model`: no head, no `model.`
    prefix on the weight names), as Qwen3-Embedding ships; they load and embed the same."""
    bare = tmp_path / "bare"
    transformers.AutoModel.from_pretrained(checkpoints["qwen2"]).save_pretrained(bare)
    transformers.AutoTokenizer.from_pretrained(checkpoints["qwen2"]).save_pretrained(bare)
    assert json.loads((bare / "config.json").read_text())["architectures"] == ["Qwen2Model"]
    with LLM(str(bare), max_num_batched_tokens=CHUNK, num_kv_blocks=64) as llm:
        outs = llm.embed(PROMPTS, use_tqdm=False)
    _close([o.outputs.embedding for o in outs], _reference(checkpoints["qwen2"], PROMPTS, "last"))


def test_unsupported_pooling_modes_and_bad_settings_are_named(checkpoints, tmp_path) -> None:
    cls_ckpt = tmp_path / "cls"
    shutil.copytree(checkpoints["llama"], cls_ckpt)
    _write_st_pooling(cls_ckpt, "cls_token")
    config = read_pooling_config(cls_ckpt, 64)
    with pytest.raises(ValueError, match="pooling_mode_cls_token"):
        config.check_request(None)
    assert read_pooling_config(cls_ckpt, 64, override="mean").pooling_type == "mean"
    with pytest.raises(ValueError, match="pooling_type must be one of last, mean"):
        EngineConfig(pooling_type="cls")
    engine_config, _ = build_serve_config(None, {"model": str(cls_ckpt), "pooling_type": "mean"})
    assert engine_config.pooling_type == "mean"  # --pooling-type / a config file's key
    with pytest.raises(ValueError, match="dimensions is not supported by this model"):
        read_pooling_config(checkpoints["llama"], 64).check_request(8)
    read_pooling_config(checkpoints["llama"], 64).check_request(64)  # its own size is fine
    with pytest.raises(ValueError, match="dimensions must be"):
        PoolingParams(dimensions=0)


def test_prefix_cache_serves_last_token_pooling_only(checkpoints) -> None:
    """Last-token pooling may take prefix-cache hits (the last token is always computed);
    mean pooling reads every row, so it computes them all. Both give the same vectors."""
    path = checkpoints["qwen2"]
    with LLM(str(path), max_num_batched_tokens=CHUNK, num_kv_blocks=64) as llm:

        def hits() -> float:
            return {m.name: m.value for m in llm.get_metrics()}["conveyor:prefix_cache_hits"]

        for pooling in ("last", "mean"):
            first = llm.embed([LONG], PoolingParams(pooling_type=pooling), use_tqdm=False)
            before = hits()
            again = llm.embed([LONG], PoolingParams(pooling_type=pooling), use_tqdm=False)
            assert (hits() > before) == (pooling == "last")
            assert again[0].outputs.embedding == first[0].outputs.embedding
            _close([again[0].outputs.embedding], _reference(path, [LONG], pooling))


def test_preempted_embedding_requests_recompute_the_same_vector(checkpoints) -> None:
    """A cache too small for a generation and an embedding together preempts (recompute):
    the mean's sum starts afresh, and both pooling types still match transformers."""
    path = checkpoints["qwen2"]
    with LLM(str(path), max_num_batched_tokens=CHUNK, num_kv_blocks=7) as llm:
        engine = llm.llm_engine
        greedy = SamplingParams(max_tokens=70, ignore_eos=True, temperature=0)
        engine.add_request("gen", list(range(5, 35)), greedy)
        for pooling in ("mean", "last"):
            params = SamplingParams(max_tokens=1, pooling=PoolingParams(pooling_type=pooling))
            engine.add_request(pooling, LONG, params)
        seqs = {rid: engine._seqs[rid].request for rid in ("gen", "mean", "last")}
        finals = {}
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        assert seqs["mean"].num_preemptions > 0  # the latest admitted: the victim
        assert len(finals["gen"].outputs[0].token_ids) == 70
        for pooling in ("mean", "last"):
            assert finals[pooling].outputs[0].finish_reason == "stop"
            assert finals[pooling].outputs[0].token_ids == []
            _close([finals[pooling].embedding], _reference(path, [LONG], pooling))


# ---------------------------------------------------------------- the HTTP server


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    args = ["--model", str(checkpoints["st-last"]), "--served-model-name", "emb"]
    args += ["--max-num-batched-tokens", str(CHUNK), "--num-kv-blocks", "128"]
    proc = start_server(args, tmp_path_factory.mktemp("serve-embed"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _floats(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


@pytest.mark.slow
def test_server_embeddings_match_transformers_in_every_input_shape(
    server, client, checkpoints
) -> None:
    path = checkpoints["st-last"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = ["Hello world!", "The quick brown fox jumps over the lazy dog. " * 4, "def add(a, b):"]
    ids = [tok.encode(t) for t in texts]
    assert len(ids[1]) > 2 * CHUNK
    want = _reference(path, ids, "last")  # the checkpoint's sentence-transformers pooling

    def prompt_tokens() -> float:
        text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        return metric_value(text, "conveyor:prompt_tokens_total")

    before = prompt_tokens()
    # The official client asks for base64 by default and decodes it.
    res = client.embeddings.create(model="emb", input=texts)
    assert prompt_tokens() - before == sum(map(len, ids))
    assert res.object == "list" and res.model == "emb"
    assert [d.index for d in res.data] == [0, 1, 2] and res.data[0].object == "embedding"
    _close([d.embedding for d in res.data], want)
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))

    floats = client.embeddings.create(model="emb", input=texts, encoding_format="float", user="u1")
    assert [d.embedding for d in floats.data] == [d.embedding for d in res.data]
    raw = httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"input": texts[0], "encoding_format": "base64"},
        timeout=60,
    ).json()
    assert _floats(raw["data"][0]["embedding"]) == floats.data[0].embedding  # exact float32
    assert set(raw) == {"object", "data", "model", "usage"}

    one = client.embeddings.create(model="emb", input=ids[0], encoding_format="float")
    many = client.embeddings.create(model="emb", input=ids, encoding_format="float")
    assert one.data[0].embedding == floats.data[0].embedding
    assert [d.embedding for d in many.data] == [d.embedding for d in floats.data]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["a", ""]}, "input", "input[1] is an empty string"),
        ({"input": [[]]}, "input", "empty token list"),
        ({"input": [1, 2, 10**6]}, "input", "token ids must be integers in"),
        ({"input": list(range(5, 5 + 300))}, "input", "maximum context length is 256"),
        ({"input": "hi", "dimensions": 16}, "dimensions", "not a Matryoshka model"),
        ({"input": "hi", "dimensions": 0}, "dimensions", ""),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": "hi", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens", ""),
        ({"input": "hi", "model": "other"}, "model", "does not exist"),
        ({"input": [1.5]}, "input", ""),
    ],
)
def test_server_refuses_bad_embedding_requests_naming_the_field(server, body, param, match):
    r = httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert match.lower() in error["message"].lower()


@pytest.mark.slow
def test_dimensions_400_through_the_openai_client(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="emb", input="hello", dimensions=8)
    assert info.value.body["param"] == "dimensions"


@pytest.mark.slow
def test_chat_keeps_streaming_while_long_embeddings_run(server, client) -> None:
    """Embeddings go through the same batched steps: a chat stream started alongside a
    stream of long embedding requests finishes, and so do they."""
    long_ids = list(range(3, 3 + 250))  # 16 chunks each
    errors: list[BaseException] = []
    results: list[int] = []

    def embed() -> None:
        try:
            for _ in range(3):
                r = client.embeddings.create(model="emb", input=[long_ids, long_ids[:100]])
                results.append(len(r.data))
        except BaseException as exc:  # reported below
            errors.append(exc)

    worker = threading.Thread(target=embed)
    worker.start()
    stream = client.chat.completions.create(
        model="emb",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=40,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [c for c in stream if c.choices]
    worker.join(120)
    assert not errors, errors
    assert results == [2, 2, 2]
    assert chunks[-1].choices[0].finish_reason == "length"
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    usage = [ln for ln in text.splitlines() if ln.startswith("conveyor:kv_cache_usage_perc")]
    assert usage and float(usage[0].rsplit(" ", 1)[1]) == 0.0  # every block was freed

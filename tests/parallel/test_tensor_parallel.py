"""tensor_parallel_size=2 on CPU: two real processes (gloo on 127.0.0.1) give transformers'
greedy tokens, each rank holding its own slices; start-up errors are clear ValueErrors.

Greedy tokens must equal transformers' up to a near-tie: the all-reduces sum partial
products in another order, which can flip an argmax whose two logits are within rounding
(tests/hf_checkpoints.agree_until_a_near_tie).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from gguf import GGMLQuantizationType as QType
from tests.gguf_files import write_gguf
from tests.hf_checkpoints import (
    agree_until_a_near_tie,
    greedy_reference,
    write_checkpoint,
    write_mxfp4_checkpoint,
)

from conveyor import LLM, SamplingParams
from conveyor.model.distributed.sharding import Shard
from conveyor.model.models.llama import LlamaForCausalLM

NEAR_TIE = 1e-3  # float32 logits: rounding of a different summation order
NUM_PROMPTS = 8

# llama: GQA 4/2 heads, own lm_head; qwen2: qkv bias, tied embeddings; qwen3: q/k norm, tied,
# and one KV head for two ranks (replicated); qwen2-moe: each expert's and the shared
# expert's intermediate dimension split, the router replicated; mixtral: its w1/w2/w3 names;
# gpt-oss: its sinks split by query heads, its stacked experts split once made per-expert;
# olmoe: its q/k norms over the whole projection split by heads, their mean square all-reduced;
# gpt-oss-mxfp4: its MXFP4 experts dequantized at load (the blocks are not split by rank).
CASES = {
    "llama": {}, "qwen2": {}, "qwen3": {"num_key_value_heads": 1}, "qwen2-moe": {},
    "mixtral": {}, "gpt-oss": {}, "gpt-oss-mxfp4": {}, "olmoe": {},
}  # fmt: skip


def _transformers(path):
    """transformers' float32 model of the checkpoint at path (an MXFP4 one dequantized)."""
    load = {}
    if "quantization_config" in transformers.AutoConfig.from_pretrained(path).to_dict():
        load["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load)


@pytest.fixture(scope="module", params=sorted(CASES))
def tp_case(request, tmp_path_factory, demo_model_dir):
    family = request.param
    if family == "gpt-oss-mxfp4":
        path = write_mxfp4_checkpoint(tmp_path_factory.mktemp(family), demo_model_dir)
    else:
        path = write_checkpoint(
            tmp_path_factory.mktemp(family), family, demo_model_dir, **CASES[family]
        )
    rng = random.Random(7)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(NUM_PROMPTS)
    ]
    max_tokens = [rng.randint(1, 12) for _ in range(NUM_PROMPTS)]
    hf = _transformers(path)
    refs = greedy_reference(hf, prompts, max_tokens, with_scores=True)
    # 10 blocks of 8 tokens cannot hold the batch (preemption); 16 tokens a step split the
    # longer prompts into chunks.
    llm = LLM(
        str(path), tensor_parallel_size=2, num_kv_blocks=10, block_size=8,
        max_num_batched_tokens=16, max_num_seqs=8,
    )  # fmt: skip
    yield family, hf.config, llm, prompts, max_tokens, refs
    workers = llm.llm_engine.runner.tp_workers.procs
    llm.llm_engine.shutdown()
    assert all(p.poll() is not None for p in workers)  # no orphan worker
    assert not dist.is_initialized()


def test_greedy_tokens_match_transformers_with_chunks_and_preemption(tp_case):
    family, _, llm, prompts, max_tokens, refs = tp_case
    engine = llm.llm_engine
    chunked = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        chunked.extend(
            r.request_id
            for r in out.scheduled
            if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] < r.num_prompt_tokens
        )
        return out

    engine.scheduler.schedule = spy
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.scheduler.schedule = schedule
    got = [o.outputs[0].token_ids for o in outs]
    compared = [
        agree_until_a_near_tie(g, tokens, scores, NEAR_TIE)
        for g, (tokens, scores) in zip(got, refs, strict=True)
    ]
    assert sum(compared) >= 0.9 * sum(max_tokens), (family, compared, max_tokens)
    assert chunked, "no prompt was split into chunks"
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.block_manager.num_free_blocks == 10


def test_rank0_holds_its_slices_and_kv_heads_only(tp_case):
    _, hf_config, llm, *_ = tp_case
    runner = llm.llm_engine.runner
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    d = runner.model.config.head_dim
    attn = runner.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (heads // 2, max(1, kv_heads // 2))
    # The KV cache [2, blocks, block_size, local KV heads, d]: the same blocks on each rank.
    assert tuple(runner.kv_caches[0].shape) == (2, 10, 8, max(1, kv_heads // 2), d)
    assert runner.model.model.embed_tokens.num_embeddings == -(-hf_config.vocab_size // 2)
    assert runner.vocab_size == hf_config.vocab_size  # logits are gathered whole on rank 0


def test_prompt_logprobs_match_transformers_over_the_gathered_vocabulary(tp_case):
    _, _, llm, prompts, *_ = tp_case
    prompt = prompts[0] + prompts[1]  # longer than a step's 16 tokens: chunked too
    hf = _transformers(llm.llm_engine.model_path)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for p in range(1, len(prompt)):
        got = lps[p][prompt[p]].logprob
        assert got == pytest.approx(float(expected[p - 1, prompt[p]]), abs=1e-4)


def test_shard_slices_each_weight_as_its_rank_needs():
    cfg = type("C", (), {})()
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 1, 2
    cfg.intermediate_size, cfg.vocab_size = 6, 5
    r0, r1 = (Shard.of(cfg, r, 2, LlamaForCausalLM.SPEC.tp_splits) for r in (0, 1))
    emb = torch.arange(5 * 3.0).view(5, 3)
    # vocabulary 5 over 2 ranks: 3 rows each, the last rank's third row padding zeros
    assert torch.equal(r0.slice("model.embed_tokens.weight", emb), emb[:3])
    assert torch.equal(r1.slice("lm_head.weight", emb)[:2], emb[3:])
    assert not r1.slice("lm_head.weight", emb)[2].any()
    q = torch.arange(8.0).view(8, 1)
    assert torch.equal(r1.slice("model.layers.0.self_attn.q_proj.weight", q), q[4:])
    k = torch.arange(2.0).view(2, 1)  # one KV head: both ranks hold it
    assert torch.equal(r1.slice("model.layers.0.self_attn.k_proj.bias", k.flatten()), k.flatten())
    o = torch.arange(16.0).view(2, 8)
    assert torch.equal(r1.slice("model.layers.0.self_attn.o_proj.weight", o), o[:, 4:])
    bias = torch.ones(2)
    assert torch.equal(r0.slice("model.layers.0.mlp.down_proj.bias", bias), bias)
    assert not r1.slice("model.layers.0.mlp.down_proj.bias", bias).any()  # added once
    norm = torch.ones(2)
    assert r1.slice("model.layers.0.self_attn.q_norm.weight", norm) is norm


def _children() -> set[int]:
    """This process's child pids."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        pids.update(int(p) for p in (task / "children").read_text().split())
    return pids


def test_heads_not_divisible_is_a_value_error_before_any_process(demo_model_dir):
    before = _children()
    # The demo model has 8 heads: 3 ranks cannot split them.
    with pytest.raises(ValueError, match="does not divide the model's 8 attention heads"):
        LLM(str(demo_model_dir), tensor_parallel_size=3)
    assert _children() == before


def test_a_gguf_model_is_refused_with_tensor_parallelism(tmp_path, tiny_tokenizer_dir):
    hf_dir = write_checkpoint(tmp_path / "hf", "llama", tiny_tokenizer_dir)
    file = write_gguf(hf_dir, tmp_path / "m.gguf", QType.F32)
    before = _children()
    with pytest.raises(ValueError, match="not supported for GGUF"):
        LLM(str(file), tensor_parallel_size=2)
    assert _children() == before


def test_master_port_in_use_is_a_value_error(demo_model_dir, monkeypatch):
    before = _children()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        with pytest.raises(ValueError, match=r"MASTER_PORT .* cannot be used"):
            LLM(str(demo_model_dir), tensor_parallel_size=2)
    assert _children() == before


def test_tensor_parallel_size_1_starts_no_process(demo_model_dir):
    before = _children()
    llm = LLM(str(demo_model_dir), tensor_parallel_size=1, num_kv_blocks=8)
    assert llm.llm_engine.runner.tp is None
    assert _children() == before
    assert not hasattr(llm.llm_engine.runner, "tp_workers")

"""Mixtures of experts (model/models/moe.py): routing as transformers routes, only the chosen
experts run, which layers are sparse, and bf16 close to transformers' bf16. Greedy float32
parity is in tests/model/test_parity.py (its qwen3-moe, qwen2-moe, mixtral and olmoe
checkpoints), the tensor-parallel split in tests/parallel/test_tensor_parallel.py, OLMoE's own
attention and config in tests/model/test_olmoe.py."""

from __future__ import annotations

import random
import re

import pytest
import torch
import transformers
from tests.hf_checkpoints import bf16_reference, greedy_reference, write_checkpoint
from tests.logprobs_close import check_logprobs_close

from conveyor import LLM, SamplingParams
from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.models.moe import MoEBlock

HIDDEN = 16


def _config(**moe) -> ModelConfig:
    base = dict(
        architecture="Qwen3MoeForCausalLM", vocab_size=32, hidden_size=HIDDEN,
        intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=8,
    )  # fmt: skip
    return ModelConfig(**{**base, **moe})


def _hf_router(config: ModelConfig, norm: bool):
    hf = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN, num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok, norm_topk_prob=norm,
    )  # fmt: skip
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return Qwen3MoeTopKRouter(hf)


@pytest.mark.parametrize("norm", [False, True])
def test_routing_picks_and_weighs_as_transformers_ties_included(norm):
    config = _config()
    block = MoEBlock(config, norm_topk=norm, weights_in_float=False)
    router = _hf_router(config, norm)
    torch.manual_seed(0)
    weight = torch.randn(config.num_experts, HIDDEN)
    weight[3] = weight[5] = weight[1]  # three experts tie for every token
    with torch.no_grad():
        block.gate.weight.copy_(weight)
        router.weight.copy_(weight)
    x = torch.randn(6, HIDDEN)
    weights, chosen = block.route(x)
    _, want_weights, want_chosen = router(x)
    assert torch.equal(chosen, want_chosen)
    assert torch.allclose(weights, want_weights.float())


def test_a_token_runs_only_the_experts_it_chose():
    config = _config()
    block = MoEBlock(config, norm_topk=True, weights_in_float=False)
    ran: list[int] = []
    for e, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda _m, _i, _o, e=e: ran.append(e))
    x = torch.randn(1, HIDDEN)
    with torch.no_grad():
        block(x)
        _, chosen = block.route(x)
    assert sorted(ran) == sorted(chosen[0].tolist()) and len(ran) == 2
    ran.clear()
    with torch.no_grad():  # a batch: each chosen expert once, over all of its tokens
        block(torch.randn(5, HIDDEN))
    assert len(ran) == len(set(ran))


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    config = _config(decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [config.is_sparse(i) for i in range(4)] == [False, True, False, False]
    assert not _config(num_experts=0).is_sparse(1)
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
          "num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 4}  # fmt: skip
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be 1 \.\. num_experts"):
        ModelConfig.from_hf_config(hf)


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe", "mixtral", "olmoe"])
def test_bfloat16_mixture_of_experts_is_close_to_transformers_bf16(
    family, tmp_path, tiny_tokenizer_dir
):
    path = write_checkpoint(tmp_path / family, family, tiny_tokenizer_dir, dtype=torch.bfloat16)
    rng = random.Random(11)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 30))] for _ in range(8)]
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, logprobs=5),
                       use_tqdm=False)  # fmt: skip
    diverged = check_logprobs_close(got, bf16_reference(path, prompts, [12] * len(prompts)))
    assert diverged <= len(prompts) // 2, diverged


@pytest.fixture(scope="module", params=["qwen3-moe", "qwen2-moe", "mixtral", "olmoe"])
def moe_gguf(request, tmp_path_factory, tiny_tokenizer_dir):
    from gguf import GGMLQuantizationType as QType
    from tests.gguf_files import write_gguf

    family = request.param
    root = tmp_path_factory.mktemp(family)
    hf_dir = write_checkpoint(root / "hf", family, tiny_tokenizer_dir)
    types = (QType.F32, QType.Q8_0, QType.MXFP4)  # MXFP4: llama.cpp's MXFP4_MOE experts
    files = {q: write_gguf(hf_dir, root / f"{q.name}.gguf", q) for q in types}
    rng = random.Random(13)
    vocab = transformers.AutoConfig.from_pretrained(hf_dir).vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    return hf_dir, files, prompts


def test_a_mixture_of_experts_gguf_file_holds_greedy_parity_with_its_checkpoint(moe_gguf):
    from gguf import GGMLQuantizationType as QType

    hf_dir, files, prompts = moe_gguf
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    expected = greedy_reference(hf, prompts, [12] * len(prompts))
    llm = LLM(str(files[QType.F32]), num_kv_blocks=64, dtype="float32")
    assert llm.llm_engine.runner.model.config.num_experts > 0
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("qtype_name", ["Q8_0", "MXFP4"])
def test_quantized_gguf_experts_stay_quantized_and_are_close_to_the_file_dequantized(
    moe_gguf, qtype_name
):
    from gguf import GGMLQuantizationType as QType

    from conveyor.model.cpu import cpu_kernels
    from conveyor.model.cpu.quant_linear import QuantLinear

    if cpu_kernels.load() is None:
        pytest.skip("no C kernels here")
    _, files, prompts = moe_gguf
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
    runs = {}
    for backend in ("auto", "onednn"):
        llm = LLM(str(files[QType[qtype_name]]), num_kv_blocks=64, dtype="float32",
                  linear_backend=backend)  # fmt: skip
        blocks = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, MoEBlock)]
        assert blocks
        expert_linears = [type(e.gate_up_proj) for b in blocks for e in b.experts]
        assert set(expert_linears) == ({QuantLinear} if backend == "auto" else
                                       set(expert_linears) - {QuantLinear})  # fmt: skip
        runs[backend] = llm.generate(prompts, params, use_tqdm=False)
    check_logprobs_close(runs["auto"], runs["onednn"])


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("expert_used_count", 99, "expert_used_count is 99; it must be an integer from 1 to 8"),
        ("expert_count", 7, "has shape [8, 32, 64]; with qwen3moe.expert_count 7"),
    ],
)
def test_bad_expert_metadata_is_one_clear_error(key, value, message, tmp_path, tiny_tokenizer_dir):
    from gguf import GGMLQuantizationType as QType
    from gguf import GGUFValueType
    from tests.gguf_files import write_gguf

    hf_dir = write_checkpoint(tmp_path / "hf", "qwen3-moe", tiny_tokenizer_dir)
    bad = write_gguf(hf_dir, tmp_path / "bad.gguf", QType.F32,
                     metadata={f"{{arch}}.{key}": (value, GGUFValueType.UINT32)})  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(str(bad), num_kv_blocks=16)


@pytest.mark.parametrize("qtype_name", ["Q8_0", "MXFP4", "F32"])
def test_the_experts_c_kernel_equals_the_module_loop(moe_gguf, qtype_name, monkeypatch):
    from gguf import GGMLQuantizationType as QType

    from conveyor.model.cpu import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C kernels here")
    _, files, prompts = moe_gguf
    if QType[qtype_name] not in files:
        pytest.skip("no such file")
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    llm = LLM(str(files[QType[qtype_name]]), num_kv_blocks=64, dtype="float32")
    blocks = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(b.fused is not None for b in blocks)  # on csrc/moe.c
    calls = []
    real = type(blocks[0].fused).__call__
    monkeypatch.setattr(type(blocks[0].fused), "__call__",
                        lambda self, *a: calls.append(1) or real(self, *a))  # fmt: skip
    with_c = llm.generate(prompts, params, use_tqdm=False)
    assert calls  # the steps took the C kernel
    for b in blocks:
        b.fused = None  # the module loop
    loop = llm.generate(prompts, params, use_tqdm=False)
    for c, m in zip(with_c, loop, strict=True):
        assert c.outputs[0].token_ids == m.outputs[0].token_ids
        if qtype_name != "F32":  # the same integer kernels: bit for bit
            assert c.outputs[0].logprobs == m.outputs[0].logprobs
        else:  # float32 panels: the team GEMM may sum in another order
            for got, want in zip(c.outputs[0].logprobs, m.outputs[0].logprobs, strict=True):
                assert got.keys() == want.keys()
                assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)

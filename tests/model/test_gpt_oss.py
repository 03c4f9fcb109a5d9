"""gpt-oss (models/gpt_oss.py) against transformers' GptOssForCausalLM: greedy float32 tokens
on the torch and cpu attention backends through chunked prefill (attention sinks, windows of 8
in half the layers, YaRN, the router's top-k softmax, biased experts with the clamped SwiGLU,
stacked experts in the file), bfloat16 close to transformers' bf16, the stacked experts as
loaded, the experts kept off the fused kernels, YaRN's tables, the config of the released
checkpoints and MXFP4 refused. The sinks in each kernel: tests/kernels/test_attention_sinks.py;
ample KV, preemption and chunking: tests/model/test_parity.py; tensor parallelism:
tests/parallel/test_tensor_parallel.py (their "gpt-oss" family)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tests.hf_checkpoints import bf16_reference, greedy_reference, write_checkpoint
from tests.logprobs_close import check_logprobs_close

from conveyor import LLM, SamplingParams
from conveyor.model.cpu.cpu_kernels import CpuKernels
from conveyor.model.distributed.sharding import Shard
from conveyor.model.loading.loader import load_model
from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.models.gpt_oss import GptOssForCausalLM, GptOssMoE
from conveyor.model.models.layers import rope_attention_factor, rope_inv_freq
from conveyor.model.models.moe import experts_on_host, use_grouped_gemm

LAYERS = 4  # sliding, full, sliding, full
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, demo_model_dir):
    path = write_checkpoint(
        tmp_path_factory.mktemp("gpt-oss"), "gpt-oss", demo_model_dir, num_hidden_layers=LAYERS
    )
    rng = random.Random(21)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(20, 40))] for _ in range(6)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = greedy_reference(hf, prompts, [MAX_TOKENS] * len(prompts), ignore_eos=True)
    return path, prompts, expected


def _greedy(path, prompts, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=8, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_equal_transformers_through_chunked_prefill(checkpoint, backend, monkeypatch):
    path, prompts, expected = checkpoint
    sinks_seen = []
    real = CpuKernels.paged_attention

    def spy(self, *args, **kwargs):
        sinks_seen.append(args[5] if len(args) > 5 else kwargs.get("sinks"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CpuKernels, "paged_attention", spy)
    # 16 tokens a step: every prompt is chunked, and chunks run beside decodes
    got = _greedy(path, prompts, attention_backend=backend, max_num_batched_tokens=16)
    assert got == expected
    if backend == "cpu":  # every row through the C kernel, with the sinks
        assert sinks_seen and all(s is not None for s in sinks_seen)


@pytest.mark.interpreter
def test_the_triton_backend_gives_transformers_tokens(checkpoint):
    import conveyor.kernels.launchers as triton_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not triton_kernels.INTERPRETED:
        pytest.skip("no GPU and TRITON_INTERPRET was not set when conveyor.kernels loaded")
    path, prompts, expected = checkpoint
    got = _greedy(
        path, prompts, attention_backend="triton", device=device, max_num_batched_tokens=16
    )
    assert got == expected


def test_transformers_own_tokens_change_without_the_sinks(checkpoint):
    """The parity above is not blind to the sinks: these weights' tokens depend on them."""
    path, prompts, expected = checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    without = greedy_reference(hf, prompts, [MAX_TOKENS] * len(prompts), ignore_eos=True)
    assert without != expected


def test_stacked_experts_load_as_each_experts_linears(checkpoint):
    path, *_ = checkpoint
    model = load_model(path, dtype="float32", attention_backend="torch")
    assert isinstance(model, GptOssForCausalLM)
    file = load_file(path / "model.safetensors")
    for i in range(LAYERS):
        pre, layer = f"model.layers.{i}.", model.model.layers[i]
        mlp = layer.mlp
        assert isinstance(mlp, GptOssMoE) and mlp.fused is None
        assert torch.equal(layer.self_attn.sinks, file[pre + "self_attn.sinks"])
        assert torch.equal(mlp.gate.weight, file[pre + "mlp.router.weight"])
        assert torch.equal(mlp.gate.bias, file[pre + "mlp.router.bias"])
        stack = {n: file[f"{pre}mlp.experts.{n}"] for n in ("gate_up_proj", "down_proj")}
        bias = {n: file[f"{pre}mlp.experts.{n}_bias"] for n in ("gate_up_proj", "down_proj")}
        for e, expert in enumerate(mlp.experts):
            # gate and up interleaved in the file ([..., ::2] and [..., 1::2]); ours: [gate; up]
            gate_up, gate_up_bias = stack["gate_up_proj"][e], bias["gate_up_proj"][e]
            want = torch.cat([gate_up[:, ::2].T, gate_up[:, 1::2].T])
            assert torch.equal(expert.gate_up_proj.weight, want)
            want = torch.cat([gate_up_bias[::2], gate_up_bias[1::2]])
            assert torch.equal(expert.gate_up_proj.bias, want)
            assert torch.equal(expert.down_proj.weight, stack["down_proj"][e].T)
            assert torch.equal(expert.down_proj.bias, bias["down_proj"][e])


def test_the_experts_keep_the_module_loop_on_the_c_kernels(checkpoint):
    path, *_ = checkpoint
    llm = LLM(str(path), dtype="float32", attention_backend="cpu", num_kv_blocks=16)
    model = llm.llm_engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, GptOssMoE)]
    assert len(blocks) == LAYERS and all(b.fused is None for b in blocks)  # not csrc/moe.c
    assert model.fused_layers is None  # not csrc/decoder_layers.c, which has no sinks
    assert use_grouped_gemm(model) == 0  # nor CUDA's grouped GEMMs
    assert experts_on_host(model)  # so no CUDA graph captures them


def test_bfloat16_is_close_to_transformers_bf16(checkpoint, tmp_path, demo_model_dir):
    _, prompts, _ = checkpoint
    path = write_checkpoint(
        tmp_path, "gpt-oss", demo_model_dir, dtype=torch.bfloat16, num_hidden_layers=LAYERS
    )
    llm = LLM(
        str(path), dtype="bfloat16", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = bf16_reference(path, prompts, [MAX_TOKENS] * len(prompts), ignore_eos=True)
    diverged = check_logprobs_close(got, want)
    assert diverged <= len(prompts) // 2, diverged


def test_yarn_is_transformers_own_with_truncate_false():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    tables = []
    for truncate in (False, True):
        rope = dict(
            rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
            truncate=truncate, original_max_position_embeddings=4096,
        )  # fmt: skip
        hf = transformers.GptOssConfig(num_hidden_layers=2, rope_parameters=rope)
        want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        ours = ModelConfig.from_hf_config({**hf.to_dict(), "architectures": ["GptOssForCausalLM"]},
                                          GptOssForCausalLM.SPEC.config_names)  # fmt: skip
        got = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
        assert torch.equal(got, want)
        assert rope_attention_factor(ours.rope_scaling) == factor
        tables.append(got)
    assert not torch.equal(*tables)  # truncate is read


def test_the_released_checkpoints_config_reads_as_transformers_reads_it():
    # openai/gpt-oss-20b's config.json (transformers 4 names), MXFP4 aside
    hf = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "num_attention_heads": 64,
        "num_experts_per_tok": 4, "experts_per_token": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False},
        "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "vocab_size": 201088,
    }  # fmt: skip
    c = ModelConfig.from_hf_config(hf, GptOssForCausalLM.SPEC.config_names)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (32, 4, 2880)
    assert c.layer_windows == (128, None) * 12 and c.attention_bias and c.head_dim == 64
    assert (c.swiglu_alpha, c.swiglu_limit) == (1.702, 7.0)  # alpha: transformers' default
    assert c.rope_theta == 150000 and c.rope_scaling["truncate"] is False
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["factor"] == 32.0


def test_an_mxfp4_checkpoint_is_refused_in_one_line(checkpoint, tmp_path):
    path, *_ = checkpoint
    mxfp4 = shutil.copytree(path, tmp_path / "mxfp4")
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"],
    }  # fmt: skip
    (mxfp4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MXFP4") as info:
        LLM(str(mxfp4), num_kv_blocks=16)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="MXFP4"):
        ModelConfig.from_hf_config(config)


def test_the_sinks_split_by_query_heads():
    cfg = ModelConfig("GptOssForCausalLM", 8, 8, 8, 1, 4, 2, 2, 16, num_experts=2,
                      num_experts_per_tok=1, moe_intermediate_size=4)  # fmt: skip
    ranks = [Shard.of(cfg, r, 2, GptOssForCausalLM.SPEC.tp_splits) for r in (0, 1)]
    sinks = torch.arange(4.0)
    assert torch.equal(ranks[1].slice("model.layers.0.self_attn.sinks", sinks), sinks[2:])
    q = torch.arange(8.0).view(8, 1)  # head size 2: unchanged, d rows a head
    assert torch.equal(ranks[1].slice("model.layers.0.self_attn.q_proj.weight", q), q[4:])
    router = torch.ones(2, 8)  # replicated
    assert ranks[1].slice("model.layers.0.mlp.router.weight", router) is router

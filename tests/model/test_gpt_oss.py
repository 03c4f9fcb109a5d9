"""gpt-oss (models/gpt_oss.py) against transformers' GptOssForCausalLM: greedy float32 tokens
on the torch and cpu attention backends through chunked prefill (attention sinks, windows of 8
in half the layers, YaRN, the router's top-k softmax, biased experts with the clamped SwiGLU,
stacked experts in the file), bfloat16 close to transformers' bf16, the stacked experts as
loaded, the experts kept off the fused kernels, YaRN's tables, the config of the released
checkpoints; MXFP4 checkpoints as released (write_mxfp4_checkpoint): transformers' tokens on
the weights it dequantizes, with the experts kept in their blocks or dequantized at load, the
repacked blocks against gguf's and transformers' dequantizers, malformed tensors refused in
one line; another quant_method refused. The sinks in each kernel:
tests/kernels/test_attention_sinks.py; ample KV, preemption and chunking:
tests/model/test_parity.py; tensor parallelism: tests/parallel/test_tensor_parallel.py (their
"gpt-oss" family)."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tests.hf_checkpoints import (
    MXFP4_CONFIG,
    bf16_reference,
    greedy_reference,
    write_checkpoint,
    write_mxfp4_checkpoint,
)
from tests.logprobs_close import check_logprobs_close

from conveyor import LLM, SamplingParams
from conveyor.model.cpu.cpu_kernels import CpuKernels
from conveyor.model.cpu.quant_linear import QuantExperts, QuantLinear
from conveyor.model.distributed.sharding import Shard
from conveyor.model.loading.loader import load_model
from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.loading.mxfp4 import dequantize, mxfp4_tensors, to_gguf_blocks
from conveyor.model.models.gpt_oss import GptOssForCausalLM, GptOssMoE, split_stacked_experts
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
def test_the_triton_backend_gives_transformers_tokens(checkpoint, triton_device):
    device = triton_device
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


def test_another_quantization_method_is_refused_in_one_line(checkpoint, tmp_path):
    """MXFP4 loads (below); a checkpoint of any other quant_method is refused before a
    weight is read."""
    path, *_ = checkpoint
    gptq = shutil.copytree(path, tmp_path / "gptq")
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported") as info:
        LLM(str(gptq), num_kv_blocks=16)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="'gptq'"):
        ModelConfig.from_hf_config(config)
    config["quantization_config"] = MXFP4_CONFIG
    names = GptOssForCausalLM.SPEC.config_names
    assert ModelConfig.from_hf_config(config, names).num_experts == 8


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory, demo_model_dir, checkpoint):
    """The released checkpoints' format: the experts in MXFP4 blocks (write_mxfp4_checkpoint),
    and transformers' greedy tokens on them dequantized (Mxfp4Config(dequantize=True), which
    runs on CPU), on the prompts of `checkpoint`."""
    _, prompts, _ = checkpoint
    path = write_mxfp4_checkpoint(
        tmp_path_factory.mktemp("gpt-oss-mxfp4"), demo_model_dir, num_hidden_layers=LAYERS
    )
    hf = _dequantized_by_transformers(path)
    expected = greedy_reference(hf, prompts, [MAX_TOKENS] * len(prompts), ignore_eos=True)
    return path, prompts, expected


def _dequantized_by_transformers(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    )


@pytest.mark.parametrize(
    ("linear_backend", "attention_backend"),
    [("auto", "cpu"), ("auto", "torch"), ("torch", "torch"), ("onednn", "cpu")],
)
def test_an_mxfp4_checkpoint_gives_transformers_tokens_on_its_dequantized_weights(
    mxfp4_checkpoint, linear_backend, attention_backend
):
    """Our C kernels' linears (auto) keep every expert in MXFP4 blocks (the integer dot
    products on 8-bit activations); torch and oneDNN get the experts dequantized at load. The
    greedy tokens are transformers' on the dequantized weights either way, through chunked
    prefill."""
    path, prompts, expected = mxfp4_checkpoint
    llm = LLM(
        str(path), dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16,
        linear_backend=linear_backend, attention_backend=attention_backend,
    )  # fmt: skip
    model = llm.llm_engine.runner.model
    experts = [m for b in model.modules() if isinstance(b, GptOssMoE) for m in b.experts]
    kept = [m for e in experts for m in (e.gate_up_proj, e.down_proj) if isinstance(m, QuantLinear)]
    if linear_backend == "auto":
        assert len(kept) == 2 * len(experts) == 2 * 8 * LAYERS
        assert all(set(m.qtypes) == {"MXFP4"} for m in kept)
        # the rest of the model is as in a bf16 / float32 checkpoint
        assert not isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    else:
        assert not kept
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_bfloat16_on_our_kernels_keeps_the_mxfp4_experts_and_is_close_to_transformers_bf16(
    mxfp4_checkpoint,
):
    """dtype bfloat16 on CPU with our GEMM: the other weights in bf16 under float32
    activations, the experts in their MXFP4 blocks; close (vLLM's logprobs rule) to
    transformers' bf16 run on the dequantized weights."""
    path, prompts, _ = mxfp4_checkpoint
    llm = LLM(
        str(path), dtype="bfloat16", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16
    )
    model = llm.llm_engine.runner.model
    expert = model.model.layers[0].mlp.experts[0]
    assert isinstance(expert.gate_up_proj, QuantLinear)
    assert model.model.layers[0].self_attn.qkv_proj.packed_weight.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = bf16_reference(
        path, prompts, [MAX_TOKENS] * len(prompts), ignore_eos=True,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
    )  # fmt: skip
    diverged = check_logprobs_close(got, want)
    assert diverged <= len(prompts) // 2, diverged


def test_mxfp4_experts_load_as_transformers_dequantizes_them(mxfp4_checkpoint, kernels):
    """Dequantized at load (torch linears): each expert's weights are transformers' own
    dequantized ones, bit for bit, and its biases the file's. Kept quantized: the GGUF MXFP4
    blocks each stack is repacked into dequantize (gguf's reference dequantizer) to the same
    weights, and the C kernel's output is that weight's product with x rounded as the kernel
    rounds it (two 8-bit passes), plus the bias, to float32 rounding."""
    from tests.model.test_quant_linear import (
        assert_same_up_to_fp32_order,
        quantize_like_the_kernel,
    )

    path, *_ = mxfp4_checkpoint
    hf = _dequantized_by_transformers(path)
    dense = load_model(path, dtype="float32", attention_backend="torch")
    kept = load_model(path, dtype="float32", attention_backend="torch", keep_quantized=True)
    # the stacks as the loader repacks them, cut into each expert's pieces
    file = load_file(path / "model.safetensors")
    pieces = {
        name: piece
        for stack, value in mxfp4_tensors(iter(file.items()), True, torch.float32)
        if isinstance(value, QuantExperts)
        for name, piece in split_stacked_experts(stack, value)
    }
    assert len(pieces) == LAYERS * 8 * 3
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    for i in range(LAYERS):
        theirs = hf.model.layers[i].mlp.experts
        for e in range(8):
            ours, quant = dense.model.layers[i].mlp.experts[e], kept.model.layers[i].mlp.experts[e]
            gate_up = theirs.gate_up_proj[e]  # [H, 2I], gate and up interleaved
            want = torch.cat([gate_up[:, ::2].T, gate_up[:, 1::2].T])
            assert torch.equal(ours.gate_up_proj.weight, want)
            assert torch.equal(ours.down_proj.weight, theirs.down_proj[e].T)
            bias = theirs.gate_up_proj_bias[e]
            assert torch.equal(ours.gate_up_proj.bias, torch.cat([bias[::2], bias[1::2]]))
            assert torch.equal(ours.down_proj.bias, theirs.down_proj_bias[e])
            base = f"model.layers.{i}.mlp.experts.{e}"
            parts = {
                "gate_up_proj": [pieces[f"{base}.{p}_proj.weight"] for p in ("gate", "up")],
                "down_proj": [pieces[f"{base}.down_proj.weight"]],
            }
            for name, blocks in parts.items():
                linear, dense_linear = getattr(quant, name), getattr(ours, name)
                weight = dense_linear.weight
                assert torch.equal(torch.cat([p.dequantize() for p in blocks]), weight)
                assert isinstance(linear, QuantLinear) and linear.qtypes[0] == "MXFP4"
                xs = x[:, : linear.in_features]
                with torch.inference_mode():
                    got = linear(xs)
                want_bias = dense_linear.bias.detach()
                assert_same_up_to_fp32_order(got, quantize_like_the_kernel(xs), weight, want_bias)


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


def test_mxfp4_blocks_repack_into_ggufs_blocks_of_the_same_values():
    """Every E8M0 scale byte but the NaN (0 and 1 give subnormal scales, 254 infinities for
    the larger values) and every code: HF's groups repacked into GGUF's MXFP4 blocks
    dequantize (gguf's reference) to the values transformers' own dequantizer gives them,
    bit for bit, and so does loading/mxfp4.py's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (1, 255, 3, 16), dtype=torch.uint8, generator=gen)
    scales = torch.arange(255, dtype=torch.uint8).view(1, 255, 1).expand(1, 255, 3).contiguous()
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [1, cols, rows]
    ours = dequantize(blocks, scales, torch.float32)  # [1, rows, cols]
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert ours.isinf().any() and (ours[0, :2].abs().min() < 2.0**-126)  # both ends reached
    repacked = to_gguf_blocks(blocks, scales)
    assert repacked.shape == (1, 255, 3 * 17)
    with np.errstate(over="ignore"):  # (the infinities)
        values = gguf_dequantize(repacked[0].numpy(), GGMLQuantizationType.MXFP4)
    assert torch.equal(torch.from_numpy(values.astype("float32")).view(255, 96), ours[0])


def _edit_checkpoint(src, dst, edit):
    """A copy of the MXFP4 checkpoint at src in dst with `edit` applied to its tensors."""
    from safetensors.torch import save_file

    folder = shutil.copytree(src, dst)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


_STACK = "model.layers.1.mlp.experts.gate_up_proj"


def _drop_scales(t):
    del t[f"{_STACK}_scales"]


def _half_blocks(t):
    t[f"{_STACK}_blocks"] = t[f"{_STACK}_blocks"][..., :8].contiguous()


def _fewer_scales(t):
    t[f"{_STACK}_scales"] = t[f"{_STACK}_scales"][..., :1].contiguous()


def _nan_scale(t):
    t[f"{_STACK}_scales"][3, 5, 1] = 0xFF


def _overflowing_scale(t):
    t[f"{_STACK}_scales"][0, 2, 0] = 254
    t[f"{_STACK}_blocks"][0, 2, 0, 0] = 0x07  # 6 x 2^127


def _float_blocks(t):
    t[f"{_STACK}_blocks"] = t[f"{_STACK}_blocks"].float()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop_scales, rf"{_STACK}_blocks has no {_STACK}_scales; each expert stack needs"),
        (_half_blocks, r"_blocks has shape \[8, 64, 2, 8\]; MXFP4 experts are"),
        (_fewer_scales, r"_scales has shape \[8, 64, 1\]; its _blocks \[8, 64, 2, 16\] need"),
        (_nan_scale, r"_scales holds the E8M0 NaN \(0xFF\) at \[3, 5, 1\]; a model with"),
        (_overflowing_scale, r"holds the scale 2\^127, which takes its group's weights past"),
        (_float_blocks, r"must be uint8, got torch.float32 and torch.uint8"),
    ],
)
def test_a_malformed_mxfp4_tensor_is_one_line_naming_it(mxfp4_checkpoint, tmp_path, edit, message):
    path, *_ = mxfp4_checkpoint
    bad = _edit_checkpoint(path, tmp_path / "bad", edit)
    for keep in (True, False):  # kept quantized, and dequantized
        with pytest.raises(ValueError, match=message) as info:
            load_model(bad, dtype="float32", attention_backend="torch", keep_quantized=keep)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message):
        LLM(str(bad), num_kv_blocks=16)


def test_bfloat16_dequantizes_the_mxfp4_experts_exactly(mxfp4_checkpoint):
    """A bf16 model (and any dtype the C kernels do not keep blocks for) gets the experts
    dequantized at load: every MXFP4 value is a bf16 one, so they are transformers' float32
    weights exactly."""
    path, *_ = mxfp4_checkpoint
    hf = _dequantized_by_transformers(path)
    model = load_model(path, dtype="bfloat16", attention_backend="torch", keep_quantized=True)
    for i in range(LAYERS):
        expert, theirs = model.model.layers[i].mlp.experts[3], hf.model.layers[i].mlp.experts
        assert type(expert.down_proj) is torch.nn.Linear
        assert expert.down_proj.weight.dtype == torch.bfloat16
        assert torch.equal(expert.down_proj.weight.float(), theirs.down_proj[3].T)

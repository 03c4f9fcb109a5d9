"""OLMoE (models/olmoe.py) against transformers' OlmoeForCausalLM in float32: greedy tokens
equal and logprobs close on the torch and cpu attention backends through chunked prefill; the
config's variants (norm_topk_prob, clip_qkv, tied embeddings, attention biases), each shown
to change transformers' own tokens; llama.cpp `olmoe` GGUF files (F16, and norm_topk_prob as
expert_weights_norm) equal to their checkpoint; the q/k norms split for tensor parallelism;
the defaults of a config.json that leaves keys out; what is refused, in one line. Ample KV,
preemption and chunking: tests/model/test_parity.py ("olmoe"); bf16, F32 and Q8_0 GGUF files
and the experts' C kernel: tests/model/test_moe.py; two real ranks:
tests/parallel/test_tensor_parallel.py."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch
import transformers
from tests.hf_checkpoints import greedy_reference, write_checkpoint

from conveyor import LLM, SamplingParams
from conveyor.model.cpu import cpu_kernels
from conveyor.model.distributed.sharding import Shard
from conveyor.model.loading.hf_config import model_config
from conveyor.model.models.moe import MoEBlock
from conveyor.model.models.olmoe import OlmoeAttention, OlmoeForCausalLM, ProjectionNorm

MAX_TOKENS = 10
# transformers' float32 against ours: the same sums in another order.
LOGPROB_TOL = 1e-4
# norm_topk_prob, clip_qkv (active: the normalized q and k are about +-1), tied embeddings
# and q/k/v/o biases, all unlike the base "olmoe" checkpoint.
VARIANT = dict(norm_topk_prob=True, clip_qkv=0.8, tie_word_embeddings=True, attention_bias=True)


def _prompts(path, seed: int, count: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    return [[rng.randrange(vocab) for _ in range(rng.randint(12, 36))] for _ in range(count)]


def _hf(path, **overrides):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **overrides
    ).eval()


def _greedy(model, prompts, **kwargs):
    llm = LLM(str(model), dtype="float32", num_kv_blocks=64, block_size=8, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, demo_model_dir):
    path = write_checkpoint(
        tmp_path_factory.mktemp("olmoe"), "olmoe", demo_model_dir, num_hidden_layers=3
    )
    prompts = _prompts(path, 5)
    expected = greedy_reference(_hf(path), prompts, [MAX_TOKENS] * len(prompts), ignore_eos=True)
    return path, prompts, expected


@pytest.fixture(scope="module")
def variant(tmp_path_factory, demo_model_dir):
    path = write_checkpoint(tmp_path_factory.mktemp("olmoe-variant"), "olmoe", demo_model_dir,
                            seed=3, **VARIANT)  # fmt: skip
    prompts = _prompts(path, 9)
    runs = {"as saved": {}, "no clip": {"clip_qkv": None}, "no renorm": {"norm_topk_prob": False}}
    max_tokens = [MAX_TOKENS] * len(prompts)
    refs = {
        name: greedy_reference(_hf(path, **over), prompts, max_tokens, ignore_eos=True)
        for name, over in runs.items()
    }
    return path, prompts, refs


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_equal_and_logprobs_close_to_transformers(checkpoint, backend):
    path, prompts, expected = checkpoint
    # 16 tokens a step: every prompt is chunked, and chunks run beside decodes
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=8,
              attention_backend=backend, max_num_batched_tokens=16)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=3, prompt_logprobs=1)  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    hf = _hf(path)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():  # every position's logprobs in one forward
            want = hf(torch.tensor([prompt + tokens[:-1]])).logits[0].log_softmax(-1)
        for p in range(1, len(prompt)):
            got = out.prompt_logprobs[p][prompt[p]].logprob
            assert abs(got - want[p - 1, prompt[p]].item()) < LOGPROB_TOL
        for k, top in enumerate(out.outputs[0].logprobs):
            assert len(top) >= 3
            for token, lp in top.items():
                assert abs(lp.logprob - want[len(prompt) - 1 + k, token].item()) < LOGPROB_TOL
    model = llm.llm_engine.runner.model
    assert all(type(layer.self_attn) is OlmoeAttention for layer in model.model.layers)
    assert model.fused_layers is None  # csrc/decoder_layers.c runs the plain Llama layer only
    if backend == "cpu" and cpu_kernels.load() is not None:
        blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
        assert len(blocks) == 3 and all(b.fused is not None for b in blocks)  # csrc/moe.c
        assert model.model.layers[0].self_attn.q_norm.kernels is not None


@pytest.mark.interpreter
def test_the_triton_backend_gives_transformers_tokens(checkpoint, triton_device):
    device = triton_device
    path, prompts, expected = checkpoint
    # (on CUDA: the Triton norms on the q/k slices' strided rows, the grouped-GEMM experts)
    _, got = _greedy(path, prompts[:2], attention_backend="triton", device=device,
                     max_num_batched_tokens=16)  # fmt: skip
    assert got == expected[:2]


def test_the_configs_variants_hold_parity_and_each_changes_transformers_tokens(variant):
    path, prompts, refs = variant
    _, got = _greedy(path, prompts, attention_backend="torch")
    assert got == refs["as saved"]
    # the checkpoint's clip_qkv and norm_topk_prob each decide tokens: the parity reads them
    assert refs["no clip"] != refs["as saved"] and refs["no renorm"] != refs["as saved"]


def test_a_gguf_file_reads_norm_topk_as_expert_weights_norm_and_keeps_ties_and_biases(
    variant, tmp_path
):
    from gguf import GGMLQuantizationType as QType
    from gguf import GGUFValueType
    from tests.gguf_files import write_gguf

    path, prompts, refs = variant
    # llama.cpp's olmoe files carry no clamp (its converter writes none, its graph applies
    # none): the file is the checkpoint without clip_qkv.
    flag = {"{arch}.expert_weights_norm": (True, GGUFValueType.BOOL)}
    file = write_gguf(path, tmp_path / "variant.gguf", QType.F32, metadata=flag)
    llm, got = _greedy(file, prompts)
    config = llm.llm_engine.runner.model.config
    assert config.norm_topk_prob and config.tie_word_embeddings and config.attention_bias
    assert config.clip_qkv is None
    assert got == refs["no clip"]
    # without the key: llama.cpp's olmoe default, no renormalization
    plain = write_gguf(path, tmp_path / "plain.gguf", QType.F32)
    llm, _ = _greedy(plain, prompts[:1])
    assert not llm.llm_engine.runner.model.config.norm_topk_prob


def test_an_f16_gguf_file_equals_its_f16_checkpoint(checkpoint, tmp_path, demo_model_dir):
    from gguf import GGMLQuantizationType as QType
    from safetensors.torch import load_file
    from tests.gguf_files import write_gguf

    _, prompts, _ = checkpoint
    # float16 weights both sides: transformers computes in float32 on the same values
    f16 = write_checkpoint(tmp_path / "hf", "olmoe", demo_model_dir, dtype=torch.float16,
                           num_hidden_layers=3)  # fmt: skip
    file = write_gguf(f16, tmp_path / "f16.gguf", QType.F16)
    expected = greedy_reference(_hf(f16), prompts, [MAX_TOKENS] * len(prompts), ignore_eos=True)
    llm, got = _greedy(file, prompts)
    assert got == expected
    model, saved = llm.llm_engine.runner.model, load_file(f16 / "model.safetensors")
    attn = model.model.layers[2].self_attn
    for name in ("q_norm", "k_norm"):  # blk.2.attn_{q,k}_norm: the whole projection's width
        want = saved[f"model.layers.2.self_attn.{name}.weight"].float()
        assert torch.equal(getattr(attn, name).weight, want)


def test_gguf_tensor_names():
    names = OlmoeForCausalLM.SPEC.gguf
    assert names.architecture == "olmoe" and not names.permuted_qk
    assert names.hf_name("blk.4.attn_q_norm.weight") == "model.layers.4.self_attn.q_norm.weight"
    assert names.hf_name("blk.4.attn_k_norm.weight") == "model.layers.4.self_attn.k_norm.weight"
    assert names.hf_name("blk.4.ffn_gate_inp.weight") == "model.layers.4.mlp.gate.weight"
    assert names.experts == "mlp.experts.{e}"  # blk.N.ffn_{gate,up,down}_exps, split per expert


def _olmoe_config(**changes) -> dict:
    hf = transformers.OlmoeConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=128,
    ).to_dict()  # fmt: skip
    hf["architectures"] = ["OlmoeForCausalLM"]
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    return hf


def test_keys_a_config_leaves_out_take_transformers_defaults():
    defaults = transformers.OlmoeConfig()
    left_out = {"rms_norm_eps": None, "max_position_embeddings": None,
                "num_experts_per_tok": None}  # fmt: skip
    config = model_config(_olmoe_config(**left_out))
    assert config.rms_norm_eps == defaults.rms_norm_eps != 1e-6  # not ModelConfig's own
    assert config.max_position_embeddings == defaults.max_position_embeddings
    assert config.num_experts_per_tok == defaults.num_experts_per_tok
    assert config.norm_topk_prob is defaults.norm_topk_prob is False
    # the experts' width is config.json's intermediate_size
    assert (config.num_experts, config.moe_intermediate_size) == (8, 32)
    # transformers' num_local_experts alias
    assert model_config(_olmoe_config(num_experts=None, num_local_experts=6)).num_experts == 6


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"head_dim": 32}, "OLMoE's q/k norms span hidden_size (64); head_dim 32 x 4 heads is 128"),
        ({"sliding_window": 8}, "OLMoE with a sliding_window (8) is not supported"),
        ({"clip_qkv": 0}, "OLMoE's clip_qkv must be a positive number or null, got 0.0"),
        ({"clip_qkv": -2.5}, "OLMoE's clip_qkv must be a positive number or null, got -2.5"),
        ({"num_experts": None}, "OLMoE's config gives no num_experts; it is required"),
    ],
)
def test_what_is_refused_is_one_line(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        model_config(_olmoe_config(**changes))
    assert "\n" not in str(info.value)


def test_a_refused_checkpoint_fails_before_it_loads(checkpoint, tmp_path):
    path, *_ = checkpoint
    bad = shutil.copytree(path, tmp_path / "windowed")
    config = json.loads((bad / "config.json").read_text())
    config["sliding_window"] = 16
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    with pytest.raises(ValueError, match=r"OLMoE with a sliding_window \(16\)") as info:
        LLM(str(bad), num_kv_blocks=16)
    assert "\n" not in str(info.value)


class _Peer:
    """The all-reduce of a group whose other ranks' sum of squares is `others`."""

    def __init__(self, size: int, others: torch.Tensor) -> None:
        self.size, self.others = size, others

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(self.others)


@pytest.mark.parametrize("kv_heads", [2, 1])  # split, and one KV head both ranks hold
def test_the_q_and_k_norms_split_by_heads_normalize_the_whole_projection(kv_heads):
    heads, d, size = 4, 8, 2
    cfg = model_config(_olmoe_config(hidden_size=heads * d, num_key_value_heads=kv_heads))
    ranks = [Shard.of(cfg, r, size, OlmoeForCausalLM.SPEC.tp_splits) for r in range(size)]
    torch.manual_seed(0)
    for leaf, width in (("q_norm", heads * d), ("k_norm", kv_heads * d)):
        weight, x = 1 + 0.1 * torch.randn(width), torch.randn(5, width)
        whole = ProjectionNorm(width, 1e-5)
        whole.weight.data.copy_(weight)
        want = whole(x)
        name = f"model.layers.0.self_attn.{leaf}.weight"
        rows = [r.slice(name, torch.arange(width)) for r in ranks]  # which columns each holds
        for r, held in enumerate(rows):
            norm = ProjectionNorm(len(held), 1e-5)
            norm.weight.data.copy_(ranks[r].slice(name, weight))
            other = rows[1 - r]
            norm.tp = _Peer(size, x[:, other].pow(2).sum(-1, keepdim=True))
            assert torch.allclose(norm(x[:, held]), want[:, held], atol=1e-6)
        if leaf == "k_norm" and kv_heads == 1:
            assert torch.equal(rows[0], rows[1])  # replicated: counted once per rank
        else:
            assert not set(rows[0].tolist()) & set(rows[1].tolist())

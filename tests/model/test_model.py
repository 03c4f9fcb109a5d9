"""Our Llama-family modules and paged attention against transformers and a dense reference."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conveyor.model.attention.cpu_attention import CpuAttentionBackend
from conveyor.model.attention.metadata import build_attention_metadata
from conveyor.model.attention.registry import get_attention_backend
from conveyor.model.attention.torch_attention import TorchAttentionBackend
from conveyor.model.cpu import cpu_build
from conveyor.model.kv_cache import allocate_kv_caches, write_kv_cache
from conveyor.model.kv_sizing import kv_cache_bytes_per_block
from conveyor.model.loading.hf_config import MODEL_REGISTRY, resolve_dtype
from conveyor.model.loading.loader import load_model
from conveyor.model.models.llama import ModelConfig

BLOCK_SIZE = 4
NUM_BLOCKS = 64
ATOL = 1e-4

_BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,  # peaked attention, so rope and masking errors show in the logits
)
# name -> (config class, extra fields, save_pretrained kwargs)
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama-gqa-untied": ("LlamaConfig", dict(tie_word_embeddings=False), {}),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, head_dim=16), {}),
    "qwen2-bias-tied": ("Qwen2Config", dict(tie_word_embeddings=True), {}),
    "qwen3-qknorm-tied": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32), {}),
    "llama3-rope-sharded": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
        dict(max_shard_size="100KB"),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def models(request, tmp_path_factory) -> tuple[Any, Any, Path]:
    """(transformers model, our model, checkpoint dir) for one family, float32, eval."""
    cls_name, extra, save_kwargs = FAMILIES[request.param]
    cfg = getattr(transformers, cls_name)(**{**_BASE, **extra})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: perturb so loading is tested
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, **save_kwargs)
    if save_kwargs:
        assert (path / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, torch.float32, "cpu")
    return hf, ours, path


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _shuffled_blocks(n: int, seed: int = 0) -> list[list[int]]:
    """Disjoint, non-contiguous, shuffled block tables of 6 blocks each for n requests."""
    ids = list(range(1, NUM_BLOCKS))  # keep block 0 unused: it is the padding entry
    random.Random(seed).shuffle(ids)
    return [ids[i * 6 : (i + 1) * 6] for i in range(n)]


def _step(model, caches, reqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """One forward of a varlen batch; reqs = (new token ids, context before, block table).

    Returns logits for every new token, in batch order.
    """
    q_lens = [len(ids) for ids, _, _ in reqs]
    s_lens = [ctx + len(ids) for ids, ctx, _ in reqs]
    meta = build_attention_metadata(q_lens, s_lens, [t for _, _, t in reqs], BLOCK_SIZE)
    input_ids = torch.tensor([i for ids, _, _ in reqs for i in ids])
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, meta.positions, caches, meta))


def _caches(model) -> list[torch.Tensor]:
    return allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prompt_logits_match_transformers(models):
    hf, ours, _ = models
    ids = _prompt(19, seed=1)
    logits = _step(ours, _caches(ours), [(ids, 0, _shuffled_blocks(1)[0])])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_transformers(models):
    hf, ours, _ = models
    ids = _prompt(21, seed=2)  # 9 + 10 prompt tokens, then 2 decode tokens
    expected = _hf_logits(hf, ids)
    caches, table = _caches(ours), _shuffled_blocks(1, seed=3)[0]
    got = [
        _step(ours, caches, [(ids[:9], 0, table)]),
        _step(ours, caches, [(ids[9:19], 9, table)]),
        _step(ours, caches, [(ids[19:20], 19, table)]),
        _step(ours, caches, [(ids[20:21], 20, table)]),
    ]
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_mixed_batch_equals_each_request_alone(models):
    hf, ours, _ = models
    a, b, c = _prompt(14, seed=4), _prompt(9, seed=5), _prompt(13, seed=6)
    ta, tb, tc = _shuffled_blocks(3, seed=7)
    caches = _caches(ours)
    # History: a has a 6-token chunk cached, b and c have their whole prompt but one token.
    _step(ours, caches, [(a[:6], 0, ta), (b[:8], 0, tb), (c[:12], 0, tc)])
    # b decodes at position 8 (first slot of its 3rd block), c at position 12 (4th block).
    reqs = [(b[8:], 8, tb), (a[6:], 6, ta), (c[12:], 12, tc)]
    alone = []
    for req in reqs:
        copy = [x.clone() for x in caches]
        alone.append(_step(ours, copy, [req]))
    mixed = _step(ours, caches, reqs)
    torch.testing.assert_close(mixed, torch.cat(alone), atol=1e-5, rtol=0)
    # ... and both are transformers' logits at those positions.
    torch.testing.assert_close(mixed[0], _hf_logits(hf, b)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[1:9], _hf_logits(hf, a)[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[9], _hf_logits(hf, c)[-1], atol=ATOL, rtol=0)


def _dense_attention(q, k, v, ctx: int, scale: float) -> torch.Tensor:
    """Naive causal GQA attention: q [n, Hq, D] at positions ctx.., k/v [ctx + n, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + ctx
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.shape[0], -1)


@pytest.mark.parametrize(
    "shapes",
    [
        [(1, 9), (5, 11), (1, 3), (7, 7), (1, 17)],  # decodes interleaved with chunks
        [(1, 5), (1, 13), (1, 1), (1, 24)],  # pure decode
        [(6, 6), (3, 10)],  # fresh prompt + continued chunk
        # short decodes around one long one: split into length groups, not contiguous
        [(1, 2), (1, 3), (1, 4), (1, 24), (3, 7), (1, 2), (1, 4), (1, 3), (1, 1)],
    ],
)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_paged_attention_matches_dense_causal_attention(shapes, backend):
    hq, hkv, d, bs = 6, 2, 8, 4
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, NUM_BLOCKS, bs, hkv, d)
    tables = _shuffled_blocks(len(shapes), seed=11)
    full = []  # each request's whole context k/v, with the history already in the cache
    for (q_len, seq), table in zip(shapes, tables, strict=True):
        k, v = torch.randn(2, seq, hkv, d, generator=gen)
        full.append((k, v))
        if seq > q_len:
            hist = build_attention_metadata([seq - q_len], [seq - q_len], [table], bs)
            write_kv_cache(k[: seq - q_len], v[: seq - q_len], cache, hist.slot_mapping)
    q_lens = [q for q, _ in shapes]
    meta = build_attention_metadata(q_lens, [s for _, s in shapes], tables, bs)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    k_new = torch.cat([k[s - n :] for (n, s), (k, _) in zip(shapes, full, strict=True)])
    v_new = torch.cat([v[s - n :] for (n, s), (_, v) in zip(shapes, full, strict=True)])
    out = get_attention_backend(backend, "cpu").forward(q, k_new, v_new, cache, meta, 0.3)
    if len(shapes) == 9 and backend == "torch":
        (plan,) = meta.backend_state.values()
        assert len(plan.decode_groups) == 2  # the long decode attends alone
    start = 0
    for (n, s), (k, v) in zip(shapes, full, strict=True):
        want = _dense_attention(q[start : start + n], k, v, s - n, 0.3)
        torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
        start += n


def test_loader_rejects_unknown_architecture(tmp_path):
    config = {**_BASE, "architectures": ["GPT2LMHeadModel"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, MistralForCausalLM"):
        load_model(tmp_path, torch.float32, "cpu")


def test_loader_names_missing_and_unexpected_weights(tmp_path):
    cfg = transformers.LlamaConfig(**_BASE)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.1.mlp.extra.weight"] = weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"gate_up_proj.*only shards \[0\].*mlp\.extra\.weight"):
        load_model(tmp_path, torch.float32, "cpu")


def test_config_reads_transformers4_rope_fields():
    base = {**_BASE, "architectures": ["LlamaForCausalLM"]}
    scaling = dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    )
    v4 = ModelConfig.from_hf_config(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}}
    )
    v5 = ModelConfig.from_hf_config(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    assert v4 == v5
    assert v4.rope_theta == 5e5 and v4.rope_scaling == {"rope_type": "llama3", **scaling}
    # yarn and dynamic are supported (test_rope_scaling); longrope is not.
    with pytest.raises(ValueError, match="Unsupported rope type 'longrope'"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2}})


def test_registry_and_backend_choice(monkeypatch):
    assert set(MODEL_REGISTRY) >= {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
    assert isinstance(get_attention_backend("auto", "cpu"), CpuAttentionBackend)
    assert isinstance(get_attention_backend("torch", "cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="runs on the CPU"):
        get_attention_backend("cpu", "cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU Triton needs the interpreter
    with pytest.raises(ValueError, match=r"Triton's interpreter.*TRITON_INTERPRET=1"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="auto, torch, cpu"):
        get_attention_backend("flash", "cpu")


def test_a_family_with_its_own_names_loads_through_its_declarations(tmp_path, monkeypatch):
    # docs/architecture.md's worked example: Llama's graph, other config.json and GGUF names.
    import dataclasses

    from conveyor.model.loading.demo import demo_model_path
    from conveyor.model.models.llama import LLAMA, LLAMA_GGUF, LlamaForCausalLM

    layers = {k: v for k, v in LLAMA_GGUF.layer_names.items() if k != "attn_output"}
    layers["attn_out"] = "self_attn.o_proj"

    class AcmeForCausalLM(LlamaForCausalLM):
        SPEC = dataclasses.replace(
            LLAMA,
            architectures=("AcmeForCausalLM", "AcmeModel"),
            config_names={"num_hidden_layers": "n_layers", "num_key_value_heads": "n_kv_heads"},
            gguf=dataclasses.replace(
                LLAMA_GGUF, architecture="acme", layer_names=layers, permuted_qk=False
            ),
        )

    monkeypatch.setitem(MODEL_REGISTRY, "AcmeForCausalLM", AcmeForCausalLM)
    demo = demo_model_path()
    hf = json.loads((demo / "config.json").read_text())
    hf["architectures"] = ["AcmeForCausalLM"]
    hf["n_layers"], hf["n_kv_heads"] = hf.pop("num_hidden_layers"), hf.pop("num_key_value_heads")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "model.safetensors").symlink_to(demo / "model.safetensors")
    acme, llama = load_model(tmp_path), load_model(demo)
    assert type(acme) is AcmeForCausalLM and acme.config.num_hidden_layers == hf["n_layers"]
    assert dataclasses.replace(acme.config, architecture="LlamaForCausalLM") == llama.config
    ours, theirs = acme.state_dict(), llama.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    gguf = AcmeForCausalLM.SPEC.gguf
    assert gguf.hf_name("blk.3.attn_out.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert gguf.gguf_name("model.layers.3.self_attn.o_proj.weight") == "blk.3.attn_out.weight"
    assert gguf.hf_name("blk.3.attn_output.weight") == "blk.3.attn_output.weight"  # not its


def test_auto_backend_is_triton_on_cuda_and_torch_when_triton_cannot_run(monkeypatch):
    import conveyor.model.attention.triton_attention as triton_attention

    monkeypatch.setattr(triton_attention, "_import_kernels", lambda device: object())
    assert isinstance(
        get_attention_backend("auto", "cuda"), triton_attention.TritonAttentionBackend
    )

    def unavailable(device):
        raise ValueError("no triton here")

    monkeypatch.setattr(triton_attention, "_import_kernels", unavailable)
    assert isinstance(get_attention_backend("auto", "cuda"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="no triton here"):
        get_attention_backend("triton", "cuda")


class _PlainBackend(TorchAttentionBackend):
    """A backend that declares neither an int8 cache nor sliding windows."""

    name = "plain"
    supports_int8_kv = False
    supports_sliding_window = False


def test_a_registered_backend_is_a_choice_and_is_asked_what_it_supports(
    monkeypatch, demo_model_dir
):
    from conveyor.config import EngineConfig
    from conveyor.model.attention import registry
    from conveyor.model.loading import loader
    from conveyor.model.runner import ModelRunner

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setitem(registry._BACKENDS, "plain", (__name__, "_PlainBackend"))
    monkeypatch.setattr(loader, "build_model", never)  # refused before the weights load
    config = EngineConfig(device="cpu", attention_backend="plain", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="'plain' cannot run an int8 KV cache"):
        ModelRunner(config, str(demo_model_dir))
    _PlainBackend.check_supports("auto", windows=False)
    with pytest.raises(ValueError, match="cannot run sliding-window layers"):
        _PlainBackend.check_supports("auto", windows=True)


def test_kv_cache_size_matches_allocation(models):
    _, ours, _ = models
    caches = _caches(ours)
    cfg = ours.config
    assert len(caches) == cfg.num_hidden_layers
    assert caches[0].shape == (2, NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    total = sum(c.numel() * c.element_size() for c in caches)
    assert kv_cache_bytes_per_block(cfg, BLOCK_SIZE, torch.float32) * NUM_BLOCKS == total


def test_kv_cache_default_fits_the_demo_and_never_exceeds_what_max_num_seqs_can_use(
    demo_model_dir,
):
    from conveyor.config import EngineConfig
    from conveyor.model.kv_sizing import DEMO_KV_CACHE_SPACE_GB
    from conveyor.model.runner import ModelRunner

    demo = ModelRunner(EngineConfig(device="cpu"), str(demo_model_dir))  # config.model None
    per_block = kv_cache_bytes_per_block(demo.model.config, 16, torch.float32)
    assert demo.num_kv_blocks == int(DEMO_KV_CACHE_SPACE_GB * 2**30) // per_block
    # A budget far beyond need: 2 sequences of max_model_len 256 hold 2 * 16 blocks at most.
    big = EngineConfig(
        model=str(demo_model_dir), device="cpu", max_num_seqs=2, max_model_len=256,
        kv_cache_space_gb=4.0,
    )  # fmt: skip
    assert ModelRunner(big, str(demo_model_dir)).num_kv_blocks == 2 * 256 // 16


def test_resolve_dtype_auto_on_cpu_is_bf16_for_a_bf16_checkpoint_with_native_bf16_only(
    monkeypatch,
):
    cpu = torch.device("cpu")
    bf16, fp16 = {"dtype": "bfloat16"}, {"torch_dtype": "float16"}
    for flags, want in (({"avx2", "fma"}, torch.float32), ({"avx512_bf16"}, torch.bfloat16),
                        ({"amx_bf16", "avx512f"}, torch.bfloat16)):  # fmt: skip
        monkeypatch.setattr(cpu_build, "cpu_flags", lambda flags=flags: set(flags))
        assert resolve_dtype("auto", cpu, bf16) is want
        # float32 and float16 checkpoints (a quantized GGUF file's "float16"), or none: fp32
        for other in ({"dtype": "float32"}, fp16, None):
            assert resolve_dtype("auto", cpu, other) is torch.float32
        assert resolve_dtype("float32", cpu, bf16) is torch.float32


def test_resolve_dtype_auto_follows_a_half_precision_checkpoint_on_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    bf16 = {"dtype": "bfloat16"}
    assert resolve_dtype("auto", cuda) is torch.bfloat16  # EngineConfig.dtype "auto"
    assert resolve_dtype("auto", cuda, {"torch_dtype": "float16"}) is torch.float16
    assert resolve_dtype("auto", cuda, bf16) is torch.bfloat16
    # A float32 checkpoint runs in bfloat16 on CUDA unless float32 is asked for.
    assert resolve_dtype("auto", cuda, {"torch_dtype": "float32"}) is torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype(torch.float16, cuda, bf16) is torch.float16
    with pytest.raises(ValueError, match="dtype must be auto, float32, float16, bfloat16"):
        resolve_dtype("fp8", cpu)


def test_loading_shows_a_progress_bar_over_shards_only_when_there_are_several(tmp_path, capsys):
    cfg = transformers.LlamaConfig(**_BASE)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    hf.save_pretrained(tmp_path / "single")
    shards = len(list((tmp_path / "sharded").glob("model-*.safetensors")))
    assert shards >= 2
    capsys.readouterr()
    load_model(tmp_path / "sharded", torch.float32, "cpu")
    err = capsys.readouterr().err
    assert "Loading safetensors shards" in err and f"{shards}/{shards}" in err
    load_model(tmp_path / "single", torch.float32, "cpu")
    assert "Loading safetensors shards" not in capsys.readouterr().err

"""Every decoder layer of a step in one C call (conveyor.model.cpu.fused_layers) gives bit for bit
what the layers' modules give one by one, on every kind of linear it takes (float32 and
bfloat16 panels, GGUF blocks of several types in one fused weight), with qkv biases, a
sliding window, a bfloat16 cache and batches that mix prefill chunks and decode rows; and the
models and steps it does not take run the modules."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from tests.gguf_files import write_gguf
from tests.hf_checkpoints import write_checkpoint

from conveyor import LLM, SamplingParams
from conveyor.model.cpu import cpu_kernels
from conveyor.model.cpu.fused_layers import FusedLayers

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
# case: (family, config overrides, GGUF type or None for the HF folder, LLM arguments)
CASES = {
    "llama-f32": ("llama", {}, None, {}),
    "qwen2-bias-bf16": ("qwen2", {}, None, {"dtype": "bfloat16"}),
    "mistral-window": ("mistral", {"sliding_window": 8}, None, {}),
    "llama-q4_k": ("llama", WIDE, QType.Q4_K, {}),
    # Q6_K: the activation sums besides the blocks, with the default two passes
    "llama-q6_k": ("llama", WIDE, QType.Q6_K, {}),
    "qwen2-q8_0-one-pass": ("qwen2", {}, QType.Q8_0, {"quant_activation_passes": 1}),
    # MXFP4: E8M0 scales and the -12 sum(qx) activation sums, each thread its own
    "llama-mxfp4": ("llama", {}, QType.MXFP4, {}),
}


def _llm(case: str, root, tokenizer_dir) -> LLM:
    family, overrides, qtype, kwargs = CASES[case]
    path = write_checkpoint(root / "hf", family, tokenizer_dir, **overrides)
    if qtype is not None:
        path = write_gguf(path, root / f"{case}.gguf", qtype)
    # our GEMM even where "auto" takes oneDNN (a portable build: tests/model/test_cpu_isa.py)
    return LLM(
        str(path), enable_prefix_caching=False, max_num_seqs=8, max_num_batched_tokens=64,
        num_kv_blocks=64, linear_backend="cpu", **kwargs,
    )  # fmt: skip


def _run(llm: LLM, fused: bool) -> list:
    model = llm.llm_engine.runner.model
    keep, model.fused_layers = model.fused_layers, model.fused_layers if fused else None
    try:
        # Lengths from 1 to 40 in one batch of 6, under a 64-token budget: steps that mix
        # prefill chunks with decode rows, then decode only.
        prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(n)]}
                   for i, n in enumerate((1, 5, 12, 23, 31, 40))]  # fmt: skip
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, ignore_eos=True)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [(c.token_ids, [{k: v.logprob for k, v in p.items()} for p in c.logprobs])
                for c in outs]  # fmt: skip
    finally:
        model.fused_layers = keep


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_call_for_every_layer_is_bit_for_bit_the_modules(case, tmp_path, tiny_tokenizer_dir):
    llm = _llm(case, tmp_path, tiny_tokenizer_dir)
    fused = llm.llm_engine.runner.model.fused_layers
    assert isinstance(fused, FusedLayers)
    calls = []
    real = fused._call
    fused._call = lambda *a: calls.append(a[3]._obj.t) or real(*a)
    got = _run(llm, fused=True)
    assert calls, "no step ran fused"
    if CASES[case][2] is not None and fused._gemm_rows is not None:
        # GGUF blocks where the kernels take one row at a time: from gemm_rows rows a step
        # takes the dequantized GEMM (the modules)
        assert max(calls) < fused._gemm_rows
    assert got == _run(llm, fused=False)  # token ids and every logprob, exactly


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("case", ["qwen2-bias-bf16", "llama-q4_k"])
def test_the_one_region_gives_the_same_bits_on_any_number_of_threads(
    case, threads, tmp_path, tiny_tokenizer_dir
):
    """The step's one OpenMP region splits each kernel's work among however many threads
    torch has (three: the decode GEMM's halves of groups do not split evenly); the results
    are the modules' on the usual two."""
    llm = _llm(case, tmp_path, tiny_tokenizer_dir)
    want = _run(llm, fused=False)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _run(llm, fused=True)
    finally:
        torch.set_num_threads(before)
    assert got == want


def test_models_it_cannot_run_keep_the_modules(tmp_path, tiny_tokenizer_dir):
    qwen3 = write_checkpoint(tmp_path / "qwen3", "qwen3", tiny_tokenizer_dir)  # q/k norms
    assert LLM(str(qwen3), num_kv_blocks=16).llm_engine.runner.model.fused_layers is None
    llama = write_checkpoint(tmp_path / "llama", "llama", tiny_tokenizer_dir)
    for kwargs in ({"attention_backend": "torch"}, {"linear_backend": "torch"},
                   {"linear_backend": "onednn"}):  # fmt: skip
        llm = LLM(str(llama), num_kv_blocks=16, **kwargs)
        assert llm.llm_engine.runner.model.fused_layers is None, kwargs
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 3


def test_a_cache_slot_outside_the_cache_is_a_value_error_not_a_crash(tmp_path, tiny_tokenizer_dir):
    llm = _llm("llama-f32", tmp_path, tiny_tokenizer_dir)
    runner = llm.llm_engine.runner
    model, fused = runner.model, runner.model.fused_layers
    from conveyor.model.attention.metadata import build_attention_metadata

    meta = build_attention_metadata([1], [1], [[0]], runner.block_size)
    meta.slot_mapping = torch.tensor([10**6], dtype=torch.int64)
    x = model.model.embed_tokens(torch.tensor([5]))
    with pytest.raises(ValueError, match="cache slot is outside"):
        fused(x, meta.positions, runner.kv_caches, meta)

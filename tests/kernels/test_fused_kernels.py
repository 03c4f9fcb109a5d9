"""conveyor.kernels.fused: RMSNorm (residual add fused in), rotary and SiLU * up on CUDA, against
the torch modules of models/layers.py.

Without a GPU the kernels run in Triton's interpreter in fp32 (its bf16 arithmetic is wrong);
with one they also run in bf16 and fp16, and an engine on them (attention_backend triton)
agrees with the all-torch engine by vLLM's logprobs rule.
"""

from __future__ import annotations

import pytest
import torch
from tests.hf_checkpoints import write_checkpoint
from tests.logprobs_close import check_logprobs_close

from conveyor import LLM, SamplingParams
from conveyor.model.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.interpreter
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if CUDA else [torch.float32]
# Tolerances: fp32 differs in the mean's summation order only; bf16/fp16 by one rounding.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def fused():
    import conveyor.kernels.launchers as launchers

    if not CUDA and not launchers.INTERPRETED:
        pytest.skip("no GPU and TRITON_INTERPRET was not set when conveyor.kernels loaded")
    import conveyor.kernels.fused as fused

    return fused


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOL[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 96, 1000])
def test_rms_norm_and_the_fused_residual_add_match_the_module(fused, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype)
    res = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    want = norm(x)
    want_x, want_sum = norm(x, res)
    _close(fused.rms_norm(x, norm.weight, 1e-6), want)
    x2, res2 = x.clone(), res.clone()
    fused.add_rms_norm_(x2, res2, norm.weight, 1e-6)
    assert torch.equal(res2, want_sum)  # the sum is rounded exactly as torch's add
    _close(x2, want_x)
    # Through the module, as the decoder calls it.
    norm.kernels = fused
    _close(norm(x), want)
    x3, res3 = norm(x.clone(), res.clone())
    _close(x3, want_x)
    assert torch.equal(res3, want_sum)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,head_dim", [(6, 64), (3, 128), (10, 32)])
def test_rotary_matches_apply_rotary_in_place(fused, dtype, heads, head_dim):
    emb = RotaryEmbedding(head_dim, 512, 10000.0).to(DEVICE)
    emb.cos_sin_cache = emb.cos_sin_cache.to(dtype)
    gen = torch.Generator().manual_seed(heads)
    positions = torch.tensor([0, 7, 511, 100], device=DEVICE)
    # A [T, heads, D] view with a token stride wider than heads * D, as rope sees qkv's rows.
    qkv = torch.randn(4, heads + 2, head_dim, generator=gen).to(DEVICE, dtype)
    x = qkv[:, :heads]
    want = apply_rotary(x, *emb(positions))
    untouched = qkv[:, heads:].clone()
    fused.rotary_step(positions, emb.cos_sin_cache)(x)
    _close(x, want)
    assert torch.equal(qkv[:, heads:], untouched)
    # Through RopeStep, as the attention layer calls it.
    emb.kernels = fused
    x = torch.randn(4, heads, head_dim, generator=gen).to(DEVICE, dtype)
    want = apply_rotary(x, *emb(positions))
    _close(emb.step(positions)(x), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [64, 1500])
def test_silu_mul_matches_the_mlp(fused, dtype, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = torch.randn(3, 2 * width, generator=gen).to(DEVICE, dtype) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    _close(fused.silu_mul(gate_up), want)
    mlp = GatedMLP(16, width).to(DEVICE, dtype)
    x = torch.randn(3, 16, generator=gen).to(DEVICE, dtype)
    want = mlp(x)
    mlp.kernels = fused
    _close(mlp(x), want)


def test_launchers_reject_bad_inputs(fused):
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        fused.rms_norm(x, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        fused.add_rms_norm_(x, torch.zeros(2, 4, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="width must be even"):
        fused.silu_mul(torch.zeros(2, 5, device=DEVICE))
    table = torch.zeros(9, 8, device=DEVICE)
    rotate = fused.rotary_step(torch.zeros(2, dtype=torch.long, device=DEVICE), table)
    with pytest.raises(ValueError, match="x must be"):
        rotate(torch.zeros(3, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="positions must be int64"):
        fused.rotary_step(torch.zeros(2, device=DEVICE), table)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_engine_on_the_fused_kernels_agrees_with_all_torch(tmp_path, demo_model_dir):
    """bf16 on CUDA: attention_backend triton (Triton attention and these kernels) against
    torch (neither), greedy with logprobs, by vLLM's check_logprobs_close."""
    path = write_checkpoint(tmp_path, "qwen2", demo_model_dir)
    prompts = [[(13 * i + n) % 400 + 20 for i in range(n)] for n in (5, 31, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    outs = {}
    for backend in ("triton", "torch"):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", attention_backend=backend,
                  num_kv_blocks=32)  # fmt: skip
        norm = llm.llm_engine.runner.model.model.norm
        assert (norm.kernels is not None) == (backend == "triton")
        outs[backend] = llm.generate(prompts, params, use_tqdm=False)
    check_logprobs_close(outs["triton"], outs["torch"])

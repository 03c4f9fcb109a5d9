"""oneDNN linears with prepacked weights: the same results as nn.Linear, to fp32 rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor import LLM, SamplingParams
from conveyor.model.linear import PackedLinear, pack_linears, resolve_linear_backend

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_nn_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        expected = linear(x)
        got = PackedLinear(linear.weight, linear.bias)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_pack_linears_replaces_every_linear_and_packs_a_tied_head():
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 8)
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()
            self.lm_head = None

    model = Tied()
    assert pack_linears(model) == 3
    assert not any(type(m) is nn.Linear for m in model.modules())
    hidden = torch.randn(4, 8)
    with torch.inference_mode():
        logits = model.lm_head(hidden)
    torch.testing.assert_close(logits, hidden @ model.model.embed_tokens.weight.T)


def test_backend_choice():
    assert resolve_linear_backend("auto", CPU, torch.float32) == "onednn"
    assert resolve_linear_backend("auto", CPU, torch.bfloat16) == "torch"
    assert resolve_linear_backend("torch", CPU, torch.float32) == "torch"
    with pytest.raises(ValueError, match="runs on CPU in float32 only"):
        resolve_linear_backend("onednn", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        resolve_linear_backend("mkl", CPU, torch.float32)


def test_onednn_and_torch_linears_give_the_same_greedy_tokens(demo_model_dir):
    prompts = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = {}
    for backend in ("onednn", "torch"):
        llm = LLM(str(demo_model_dir), linear_backend=backend, num_kv_blocks=64)
        assert llm.llm_engine.runner.linear_backend == backend
        runs[backend] = llm.generate(prompts, params, use_tqdm=False)
    for fast, ref in zip(runs["onednn"], runs["torch"], strict=True):
        assert fast.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(fast.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()  # the sampled token and the top one
            for tid in a:
                assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-4)

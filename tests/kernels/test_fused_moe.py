"""conveyor.kernels.fused_moe: the experts' grouped GEMMs on CUDA, against models/moe.py's
module loop. Without a GPU the kernel runs in Triton's interpreter, in fp32."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.loading.model_config import ModelConfig
from conveyor.model.models.moe import MoEBlock

pytestmark = pytest.mark.interpreter
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def fused_moe():
    import conveyor.kernels.launchers as launchers

    if not CUDA and not launchers.INTERPRETED:
        pytest.skip("no GPU and TRITON_INTERPRET was not set when conveyor.kernels loaded")
    import conveyor.kernels.fused_moe as fused_moe

    return fused_moe


def _block(experts: int, top_k: int, hidden: int, inter: int, seed: int) -> MoEBlock:
    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=8, hidden_size=hidden,
        intermediate_size=inter, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=hidden, max_position_embeddings=8,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
    )  # fmt: skip
    torch.manual_seed(seed)
    block = MoEBlock(config, norm_topk=True, weights_in_float=True)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block.to(DEVICE)


def test_sort_by_expert_groups_every_pair_once_in_blocks_of_one_expert(fused_moe):
    topk_ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]], device=DEVICE)
    pairs, block_expert = fused_moe.sort_by_expert(topk_ids, num_experts=5)
    m = fused_moe.BLOCK_M
    assert pairs.numel() == block_expert.numel() * m
    real = pairs[pairs < 8]
    assert sorted(real.tolist()) == list(range(8))  # each (token, slot) once
    flat = topk_ids.reshape(-1)
    for b, expert in enumerate(block_expert.tolist()):
        rows = pairs[b * m : (b + 1) * m]
        assert all(flat[p] == expert for p in rows[rows < 8].tolist())
    assert block_expert.tolist() == [0, 1, 2, 3]  # expert 4: no token, no block


@pytest.mark.parametrize(("experts", "top_k", "tokens"), [(8, 2, 1), (8, 3, 37), (4, 4, 20)])
def test_fused_moe_equals_the_module_loop(fused_moe, experts, top_k, tokens):
    block = _block(experts, top_k, hidden=32, inter=48, seed=tokens)
    x = torch.randn(tokens, 32, device=DEVICE)
    with torch.no_grad():
        want = block(x)
        weights, chosen = block.route(x)
        w13 = torch.stack([e.gate_up_proj.weight for e in block.experts])
        w2 = torch.stack([e.down_proj.weight for e in block.experts])
        got = fused_moe.fused_moe(x, w13, w2, weights, chosen)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_value_errors(fused_moe):
    x = torch.randn(2, 32, device=DEVICE)
    w13 = torch.randn(4, 16, 32, device=DEVICE)
    ids = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    weights = torch.ones(2, 2, device=DEVICE)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe.fused_moe(x, w13, torch.randn(4, 32, 9, device=DEVICE), weights, ids)
    with pytest.raises(ValueError, match="int64"):
        fused_moe.fused_moe(x, w13, torch.randn(4, 32, 8, device=DEVICE), weights, ids.int())


def test_a_block_on_the_grouped_gemm_holds_its_experts_once_and_answers_the_same(fused_moe):
    from conveyor.model.models.moe import use_grouped_gemm

    block = _block(6, 2, hidden=32, inter=16, seed=3)
    x = torch.randn(9, 32, device=DEVICE)
    with torch.no_grad():
        want = block(x)
        assert use_grouped_gemm(torch.nn.ModuleList([block])) == 1
        got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Each expert's weights are views of the stacks: in memory once.
    assert block.experts[4].down_proj.weight.data_ptr() == block.w2[4].data_ptr()
    assert block.experts[5].gate_up_proj.weight.untyped_storage().data_ptr() == (
        block.w13.untyped_storage().data_ptr()
    )

"""A mixture of experts' feed-forward on CUDA: grouped GEMMs over tokens sorted by expert
(vLLM's `fused_moe` shape, our own kernel), two launches for the whole block.

    topk_ids [T, k]  ──sort──►  pairs (token, slot) grouped by expert, each expert's group
                                padded to BLOCK_M rows; one expert per row block
    launch 1   h[pair]   = x[pair // k] @ w13[e].T          (gate and up: [2I] a pair)
    silu_mul   a[pair]   = silu(h[:, :I]) * h[:, I:]
    launch 2   y[pair]   = (a[pair] @ w2[e].T) * topk_weight[pair]
    out[t]     = sum over its k slots of y                   (torch)

A row block reads only its expert's weights, so a decode step reads the chosen experts
alone. The arithmetic is fp32 (tl.dot) rounded to the activations' dtype on store; the
reference is models/moe.py's module loop. Under TRITON_INTERPRET=1 it runs on CPU tensors
for tests (float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels._checks import check

BLOCK_M = 16  # pairs per row block (tl.dot's smallest tile)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, pairs_ptr, block_expert_ptr, weights_ptr,
    num_pairs, n, k, s_a, s_we, s_wn, s_wk, s_c,
    ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c[pair, cols] = a[pair // ROW_DIV] @ w[e, cols].T (* weights[pair]) for one row block
    of pairs (all of expert e) and one block of output columns."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    valid = pair < num_pairs  # padding rows hold num_pairs
    row = (pair // ROW_DIV).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        kk = start + offs_k
        a = tl.load(a_ptr + row[:, None] * s_a + kk[None, :],
                    mask=valid[:, None] & (kk[None, :] < k), other=0.0)  # fmt: skip
        w = tl.load(w_ptr + expert * s_we + offs_n[None, :] * s_wn + kk[:, None] * s_wk,
                    mask=(offs_n[None, :] < n) & (kk[:, None] < k), other=0.0)  # fmt: skip
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
    out = c_ptr + pair.to(tl.int64)[:, None] * s_c + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < n))


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, block_expert): the (token, slot) pair indices (token * k + slot) grouped by
    expert, each group padded with `T * k` to a multiple of BLOCK_M, and each row block's
    expert. Experts no token chose get no block."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = torch.cumsum(padded, 0) - padded
    firsts = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    dest = (
        starts[sorted_experts]
        + torch.arange(num_pairs, device=flat.device)
        - (firsts[sorted_experts])
    )
    pairs = torch.full((int(padded.sum()),), num_pairs, dtype=torch.int64, device=flat.device)
    pairs[dest] = order
    experts = torch.arange(num_experts, device=flat.device)
    return pairs, torch.repeat_interleave(experts, padded // BLOCK_M)


def _grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pairs: torch.Tensor,
    block_expert: torch.Tensor, weights: torch.Tensor | None, row_div: int,
) -> None:  # fmt: skip
    n, k = w.shape[1], w.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, pairs, block_expert, weights if weights is not None else out,
        out.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        ROW_DIV=row_div, MUL_WEIGHT=weights is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' weighted sum for every token.

    Args:
        x: [T, H] activations (fp16 / bf16 / fp32, contiguous rows).
        w13: [E, 2I, H] each expert's gate rows then up rows (its gate_up_proj weight).
        w2: [E, H, I] each expert's down_proj weight.
        topk_weights: [T, k] float32 routing weights.
        topk_ids: [T, k] int64 chosen experts.
    Returns:
        [T, H] in x's dtype.
    Raises:
        ValueError: shapes, dtypes or devices that do not fit.
    """
    check(x.dim() == 2 and x.stride(1) == 1, "x must be [T, H] with contiguous rows.")
    check(w13.dim() == 3 and w2.dim() == 3, "w13 and w2 must be [E, rows, cols].")
    experts, two_i, hidden = w13.shape
    check(x.shape[1] == hidden and two_i % 2 == 0, "w13 must be [E, 2I, H] for x's H.")
    check(tuple(w2.shape) == (experts, hidden, two_i // 2), "w2 must be [E, H, I].")
    check(w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights need contiguous rows.")
    check(x.dtype == w13.dtype == w2.dtype, "x and the expert weights must share a dtype.")
    same = topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2
    check(same and topk_ids.shape[0] == x.shape[0], "topk_ids and topk_weights must be [T, k].")
    check(topk_ids.dtype == torch.int64 and topk_weights.dtype == torch.float32,
          "topk_ids must be int64 and topk_weights float32.")  # fmt: skip
    check(len({x.device, w13.device, w2.device, topk_ids.device}) == 1,
          "x, the weights and the routing must be on one device.")  # fmt: skip
    tokens, top_k = topk_ids.shape
    pairs, block_expert = sort_by_expert(topk_ids, experts)
    h = torch.empty((tokens * top_k, two_i), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, h, pairs, block_expert, None, top_k)
    gate, up = h.chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).contiguous()
    y = torch.empty((tokens * top_k, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, y, pairs, block_expert, topk_weights.reshape(-1).contiguous(), 1)
    return y.view(tokens, top_k, hidden).sum(dim=1)

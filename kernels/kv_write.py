"""Paged KV write: scatter this step's new K/V rows into the cache by slot (int8 optional).

Token t goes to flat slot s = slot_mapping[t] of the [2, num_blocks, block_size, Hkv, D] cache:
block s // block_size, offset s % block_size (a negative slot means "skip this token").
One program per token moves all its KV heads, K and V: an [Hkv, D] tile each.

int8 (symmetric absmax per token and head, matching `conveyor.model.kv_cache.quantize_int8`):
    absmax = max(max_d |x[h, d]|, MIN_ABSMAX)  scale[h] = absmax * (1 / 127)
    q[h, d] = clamp(floor(x[h, d] * (127 / absmax) + 0.5), -127, 127)     x ≈ q * scale
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels._checks import check, check_kv_cache_dtype
from conveyor.model.kv_cache import MIN_ABSMAX  # the torch reference's: the same bytes

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _write_one(src, s_h, dst, scale_dst, s_shead, offs_h, offs_d, h_ok, mask,
               QUANT: tl.constexpr, MIN_ABS: tl.constexpr):  # fmt: skip
    """src: one token's [Hkv, D] rows; dst / scale_dst: its slot in the cache / scales."""
    x = tl.load(src + offs_h[:, None] * s_h + offs_d[None, :], mask=mask, other=0.0)
    dst_ptrs = dst + offs_d[None, :]  # dst: [Hkv, 1] pointers to each head's slot row
    if QUANT:
        x = x.to(tl.float32)  # right after the load: interpreted bf16 arithmetic is wrong
        absmax = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_ABS)
        inv = tl.math.div_rn(tl.zeros_like(absmax) + 127.0, absmax)  # IEEE, like torch's
        qx = tl.floor(x * inv[:, None] + 0.5)
        qx = tl.minimum(tl.maximum(qx, -127.0), 127.0)
        tl.store(dst_ptrs, qx.to(tl.int8), mask=mask)
        tl.store(scale_dst + offs_h * s_shead, absmax * (1.0 / 127.0), mask=h_ok)
    else:
        tl.store(dst_ptrs, x, mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, scales_ptr, slots_ptr,
    s_kt, s_kh, s_vt, s_vh, s_ckv, s_cblk, s_cslot, s_chead,
    s_skv, s_sblk, s_sslot, s_shead,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
    MIN_ABS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    h_ok = offs_h < NUM_KV_HEADS
    mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    # Head offsets of the destination are folded in here; _write_one adds d.
    dst = cache_ptr + blk * s_cblk + off * s_cslot + offs_h[:, None] * s_chead
    sc = scales_ptr + blk * s_sblk + off * s_sslot
    _write_one(k_ptr + t * s_kt, s_kh, dst, sc, s_shead, offs_h, offs_d, h_ok, mask, QUANT, MIN_ABS)
    _write_one(v_ptr + t * s_vt, s_vh, dst + s_ckv, sc + s_skv, s_shead, offs_h, offs_d, h_ok,
               mask, QUANT, MIN_ABS)  # fmt: skip


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write k, v [T, Hkv, D] into kv_cache at slot_mapping [T] (in place).

    Args:
        k, v: [T, Hkv, D] fp16/bf16/fp32 with a contiguous last dim (any row/head strides).
        kv_cache: [2, num_blocks, block_size, Hkv, D], k's dtype, or int8 with kv_scales.
        slot_mapping: int64 [T] flat slots (block * block_size + offset); < 0 skips a token.
        kv_scales: fp32 [2, num_blocks, block_size, Hkv], required iff kv_cache is int8.
    """
    check(k.dim() == 3 and k.shape == v.shape, "k and v must both be [T, Hkv, D].")
    check(kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, NB, BS, H, D].")
    t, hkv, d = k.shape
    check(
        tuple(kv_cache.shape[3:]) == (hkv, d),
        f"kv_cache {tuple(kv_cache.shape)} does not fit k [T, {hkv}, {d}].",
    )
    check(k.dtype in _FLOATS and v.dtype == k.dtype, f"k/v must be one float dtype: {k.dtype}.")
    check(
        k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1,
        "k, v and kv_cache need a contiguous last dim.",
    )
    check(
        slot_mapping.dtype == torch.int64 and tuple(slot_mapping.shape) == (t,),
        "slot_mapping must be int64 [T].",
    )
    for name, x in (("v", v), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        check(x.device == k.device, f"{name} is not on k's device.")
    quant = check_kv_cache_dtype(kv_cache, kv_scales, k, "k")
    if t == 0:
        return
    scales = kv_scales if quant else kv_cache  # a dummy pointer when unused
    s_scales = kv_scales.stride() if quant else (0, 0, 0, 0)
    _write_kv_kernel[(t,)](
        k, v, kv_cache, scales, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *kv_cache.stride()[:4], *s_scales,
        NUM_KV_HEADS=hkv, HEAD_DIM=d, H_PAD=triton.next_power_of_2(hkv),
        D_PAD=triton.next_power_of_2(d), BLOCK_SIZE=kv_cache.shape[2], QUANT=quant,
        MIN_ABS=MIN_ABSMAX, num_warps=4,
        enable_fp_fusion=False,  # x * inv + 0.5 rounded twice, as in torch: the same bytes
    )  # fmt: skip

"""Triton kernels against their torch references: compiled on CUDA, else in the interpreter.

tests/conftest.py switches Triton's interpreter on (TRITON_INTERPRET=1) when there is no GPU.
Interpreted launches cost ~0.1-0.5 s each, so cases are few and tiny, and each one covers
several axes at once (prefill chunks and decodes mixed, contexts that end mid-block and on a
block boundary, head sizes, GQA ratios, block sizes, dtypes).
"""

from __future__ import annotations

import random

import pytest
import torch

from conveyor.model.attention.metadata import build_attention_metadata
from conveyor.model.attention.torch_attention import paged_attention as reference
from conveyor.model.kv_cache import QuantizedKVCache, write_kv_cache

pytestmark = pytest.mark.interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Max abs error against the fp32 reference: fp32 sees only summation order; fp16/bf16 add
# the rounding of the output (values are O(1); bf16 keeps 8 bits) and of p before p @ V.
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def kernels():
    import conveyor.kernels.launchers as kernels

    if DEVICE.type == "cpu" and not kernels.INTERPRETED:
        pytest.skip("no GPU and TRITON_INTERPRET was not set when conveyor.kernels loaded")
    return kernels


def _batch(shapes, hq, hkv, d, bs, dtype, seed, quant=False):
    """A paged cache holding each request's context, written by the torch reference.

    shapes: (new tokens, context after this step) per request.
    Returns (q, new k, new v as the cache holds them, cache, metadata), all on DEVICE.
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-s // bs) for _, s in shapes]
    ids = list(range(1, sum(counts) + 2))  # block 0 stays the padding entry
    random.Random(seed).shuffle(ids)
    tables, start = [], 0
    for n in counts:
        tables.append(ids[start : start + n])
        start += n
    seqs = [s for _, s in shapes]
    full_kv = [torch.randn(2, s, hkv, d, generator=gen).to(dtype) for s in seqs]
    shape = (2, sum(counts) + 2, bs, hkv, d)
    cache = (
        QuantizedKVCache(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:4]))
        if quant
        else torch.zeros(shape, dtype=dtype)
    )
    everything = build_attention_metadata(seqs, seqs, tables, bs)
    held = write_kv_cache(*torch.cat(full_kv, 1).unbind(0), cache, everything.slot_mapping)
    starts = [0, *torch.tensor(seqs).cumsum(0).tolist()]
    pieces = [(e - n, e) for (n, _), e in zip(shapes, starts[1:], strict=True)]
    new = [torch.cat([held[i][a:b] for a, b in pieces]) for i in (0, 1)]
    meta = build_attention_metadata([n for n, _ in shapes], seqs, tables, bs, DEVICE)
    q = torch.randn(sum(n for n, _ in shapes), hq, d, generator=gen).to(dtype)
    if quant:
        cache = QuantizedKVCache(cache.data.to(DEVICE), cache.scales.to(DEVICE))
    else:
        cache = cache.to(DEVICE)
    return q.to(DEVICE), new[0].to(DEVICE), new[1].to(DEVICE), cache, meta


def _run(kernels, q, cache, meta, scale, num_splits=None):
    data, scales = (cache.data, cache.scales) if isinstance(cache, QuantizedKVCache) else (
        cache, None)  # fmt: skip
    out = kernels.paged_attention(
        q, data, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
        meta.max_query_len, meta.max_seq_len, kv_scales=scales, num_splits=num_splits,
    )  # fmt: skip
    return out.view(q.shape[0], -1)


# (shapes as (new tokens, context), Hq, Hkv, head size, block size, dtype, key splits)
CASES = {
    # decodes around chunks; contexts 17 / 21 end mid-block, 32 on a boundary; MHA (ratio 1)
    "fp32-d64-mha-bs16": ([(1, 17), (5, 21), (1, 32), (7, 7)], 2, 2, 64, 16, torch.float32, 1),
    # non-power-of-2 head size (96 in a padded 128 tile); GQA 4; chunk crossing a block
    "fp16-d96-gqa4-bs32": ([(3, 40), (1, 33), (1, 5), (9, 9)], 8, 2, 96, 32, torch.float16, 1),
    # MQA-like ratio 8, bf16 (upcast to fp32 under the interpreter)
    "bf16-d128-gqa8-bs16": ([(1, 17), (4, 20), (1, 50)], 8, 1, 128, 16, torch.bfloat16, 1),
    # pure decode with the keys split 4 ways and merged by the reduce kernel
    "fp32-d128-gqa4-bs32-split4": (
        [(1, 70), (1, 33), (1, 3), (1, 64)], 8, 2, 128, 32, torch.float32, 4,
    ),
    # a long chunk spanning several query blocks and key tiles, mixed, split 2 ways
    "fp16-d64-gqa8-bs16-split2": ([(20, 52), (1, 16), (13, 13)], 16, 2, 64, 16, torch.float16, 2),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_kernel_matches_torch_reference(kernels, case):
    shapes, hq, hkv, d, bs, dtype, splits = CASES[case]
    q, k, v, cache, meta = _batch(shapes, hq, hkv, d, bs, dtype, seed=len(case))
    scale = d**-0.5
    out = _run(kernels, q, cache, meta, scale, num_splits=splits)
    assert out.dtype == dtype and out.shape == (q.shape[0], hq * d)
    want = reference(q.float(), k.float(), v.float(), cache.float(), meta, scale)
    torch.testing.assert_close(out.float(), want, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("seed", [3, 17])  # fp16 d128 bs8 GQA8; fp32 d96 bs64 GQA4
def test_paged_attention_kernel_on_seeded_random_batches(kernels, seed):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2])
    # Block sizes beyond the 16 and 32 of CASES: a key tile may hold several blocks or part of one.
    hq, d, bs = hkv * rng.choice([1, 4, 8]), rng.choice([64, 96, 128]), rng.choice([8, 64])
    dtype = rng.choice([torch.float32, torch.float16])
    shapes = []
    for _ in range(rng.randint(2, 5)):
        new = rng.choice([1, 1, rng.randint(2, 12)])
        shapes.append((new, new + rng.choice([0, rng.randint(1, 60)])))
    q, k, v, cache, meta = _batch(shapes, hq, hkv, d, bs, dtype, seed)
    out = _run(kernels, q, cache, meta, 0.1)
    want = reference(q.float(), k.float(), v.float(), cache.float(), meta, 0.1)
    torch.testing.assert_close(out.float(), want, atol=ATOL[dtype], rtol=0)


def test_int8_cache_kernel_matches_torch_int8_reference(kernels):
    # Both dequantise the same int8 bytes; the error against float K/V is bounded in
    # tests/model/test_kv_int8.py. Here the two int8 paths must agree to fp16 rounding.
    shapes = [(1, 19), (6, 30), (1, 48)]
    q, k, v, cache, meta = _batch(shapes, 8, 2, 64, 16, torch.float16, seed=5, quant=True)
    out = _run(kernels, q, cache, meta, 0.125)
    want = reference(q.float(), k.float(), v.float(), cache, meta, 0.125)
    torch.testing.assert_close(out.float(), want, atol=ATOL[torch.float16], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", [False, True], ids=["float", "int8"])
def test_kv_write_kernel_matches_torch_scatter(kernels, dtype, quant):
    gen = torch.Generator().manual_seed(3)
    t, hq, hkv, d, nb, bs = 9, 4, 3, 96, 6, 16
    qkv = (torch.randn(t, hq + 2 * hkv, d, generator=gen) * 3).to(dtype).to(DEVICE)
    k, v = qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]  # strided views, as the model passes
    slots = torch.randperm(nb * bs, generator=gen)[:t].to(DEVICE)
    slots[4] = -1  # skipped
    shape = (2, nb, bs, hkv, d)
    if quant:
        want = QuantizedKVCache(
            torch.zeros(shape, dtype=torch.int8, device=DEVICE),
            torch.zeros(shape[:4], device=DEVICE),
        )
        got = QuantizedKVCache(want.data.clone(), want.scales.clone())
    else:
        want = torch.zeros(shape, dtype=dtype, device=DEVICE)
        got = want.clone()
    keep = slots >= 0
    write_kv_cache(k[keep], v[keep], want, slots[keep])
    if quant:
        kernels.write_kv(k, v, got.data, slots, got.scales)
        assert torch.equal(got.data, want.data)  # the same bytes, not just close
        assert torch.equal(got.scales, want.scales)
    else:
        kernels.write_kv(k, v, got, slots)
        assert torch.equal(got, want)


def test_launchers_reject_bad_inputs_with_value_errors(kernels):
    q, _, _, cache, meta = _batch([(1, 5)], 4, 2, 64, 16, torch.float32, seed=0)
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.1, 1, 5)
    with pytest.raises(ValueError, match=r"kv_cache is torch\.float16, q is torch\.float32"):
        kernels.paged_attention(q, cache.half(), *args)
    with pytest.raises(ValueError, match="not a multiple"):
        kernels.paged_attention(q[:, :3], cache, *args)
    with pytest.raises(ValueError, match="head size"):
        kernels.paged_attention(q[..., :8], cache[..., :8], *args)
    with pytest.raises(ValueError, match="contiguous D"):
        kernels.paged_attention(q.transpose(1, 2).contiguous().transpose(1, 2), cache, *args)
    with pytest.raises(ValueError, match="int32"):
        kernels.paged_attention(q, cache, meta.block_tables.long(), *args[1:])
    with pytest.raises(ValueError, match="needs fp32 kv_scales"):
        kernels.paged_attention(q, cache.to(torch.int8), *args)
    k = torch.zeros(1, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        kernels.write_kv(k, k, cache, meta.slot_mapping.int())
    with pytest.raises(ValueError, match="does not fit"):
        kernels.write_kv(k[:, :1], k[:, :1], cache, meta.slot_mapping)

"""The CPU C kernels (paged attention of the "cpu" backend, fused residual + RMSNorm, rotary,
silu * up, the sampler's argmax) against their torch references, the build cache, and the
fallbacks where they cannot run."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F
from tests.model.paged_blocks import shuffled_block_tables

from conveyor.model.attention import cpu_attention
from conveyor.model.attention.cpu_attention import CpuAttentionBackend, _CpuPlan
from conveyor.model.attention.metadata import build_attention_metadata
from conveyor.model.attention.torch_attention import paged_attention as reference
from conveyor.model.cpu import cpu_build, cpu_kernels
from conveyor.model.kv_cache import QuantizedKVCache, write_kv_cache
from conveyor.model.models.layers import (
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    use_kernels,
)

CPU = torch.device("cpu")


def _batch(shapes, hq, hkv, d, bs, seed, dtype=torch.float32, quant=False, kv_dtype=None):
    """A paged cache (shuffled blocks) holding each request's context, and this step's q/k/v.

    shapes: (new tokens, context after this step) per request.
    kv_dtype: the cache's dtype (None: `dtype`; the history is rounded to it).
    """
    gen = torch.Generator().manual_seed(seed)
    tables = shuffled_block_tables([s for _, s in shapes], bs, seed)
    shape = (2, sum(map(len, tables)) + 1, bs, hkv, d)
    cache = (
        QuantizedKVCache(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:4]))
        if quant
        else torch.zeros(shape, dtype=kv_dtype or dtype)
    )
    for (n, s), table in zip(shapes, tables, strict=True):
        if s > n:  # the history, already in the cache
            hist = build_attention_metadata([s - n], [s - n], [table], bs)
            k, v = torch.randn(2, s - n, hkv, d, generator=gen).to(dtype)
            write_kv_cache(k, v, cache, hist.slot_mapping)
    meta = build_attention_metadata([n for n, _ in shapes], [s for _, s in shapes], tables, bs)
    t = sum(n for n, _ in shapes)
    # q as the model hands it over: a view of a wider [T, Hq + Hkv, D] rotary output.
    q = torch.randn(t, hq + hkv, d, generator=gen).to(dtype)[:, :hq]
    k, v = torch.randn(2, t, hkv, d, generator=gen).to(dtype)
    return q, k, v, cache, meta


def _both(shapes, hq, hkv, d, bs, seed, **kw):
    q, k, v, cache, meta = _batch(shapes, hq, hkv, d, bs, seed, **kw)
    backend = CpuAttentionBackend(CPU)
    got = backend.forward(q, k, v, cache, meta, d**-0.5)
    (plan,) = meta.backend_state.values()  # the step's one plan (every layer full attention)
    if isinstance(plan, _CpuPlan):  # the kernel wrote this step's k, v at their slots
        flat = cache.view(2, -1, hkv, d)
        assert torch.equal(flat[0, meta.slot_mapping], k)
        assert torch.equal(flat[1, meta.slot_mapping], v)
    meta.backend_state = None
    want = reference(q, k, v, cache, meta, d**-0.5)  # cache already holds k, v
    return got, want, plan


@pytest.mark.parametrize(
    ("shapes", "hq", "hkv", "d", "bs"),
    [
        ([(1, 9), (1, 40), (1, 1), (1, 33)], 12, 4, 64, 16),  # GQA 3, lengths across blocks
        ([(1, 5), (1, 17), (1, 2)], 8, 8, 32, 4),  # no GQA
        ([(1, 7), (1, 31)], 16, 2, 128, 8),  # GQA 8, head_dim 128
        ([(1, 3), (1, 12), (1, 1)], 4, 1, 16, 1),  # one token per block, one KV head
        ([(1, 11), (1, 8), (1, 64)], 4, 2, 80, 8),  # head_dim 64 + 16 (two register runs)
        ([(1, 5), (1, 23)], 4, 2, 12, 4),  # head_dim not a multiple of 8: the portable loop
    ],
)
def test_decode_rows_match_the_torch_reference(kernels, shapes, hq, hkv, d, bs):
    got, want, plan = _both(shapes, hq, hkv, d, bs, seed=len(shapes) + d)
    assert isinstance(plan, _CpuPlan) and plan.kernel_rows.rows.numel() == len(shapes)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("d", [64, 12])  # the AVX2 path and the portable loop
def test_a_bfloat16_cache_is_read_widened_and_written_rounded(kernels, d):
    """The CPU bf16 path's cache: float32 q, k, v, a bf16 cache. The kernel rounds the new
    k, v to nearest even as it writes them and reads every row widened to float32, so it
    matches the float32 reference given the same rounded k, v."""
    shapes = [(1, 9), (5, 30), (1, 1), (3, 3)]
    q, k, v, cache, meta = _batch(shapes, 6, 2, d, 4, 7, kv_dtype=torch.bfloat16)
    got = CpuAttentionBackend(CPU).forward(q, k, v, cache, meta, d**-0.5)
    (plan,) = meta.backend_state.values()
    assert isinstance(plan, _CpuPlan) and plan.kernel_rows.rows.numel() == 10
    flat = cache.view(2, -1, 2, d)
    assert torch.equal(flat[0, meta.slot_mapping], k.bfloat16())
    assert torch.equal(flat[1, meta.slot_mapping], v.bfloat16())
    meta.backend_state = None
    rounded = (x.bfloat16().float() for x in (k, v))
    want = reference(q, *rounded, cache, meta, d**-0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_mixed_batches_run_every_row_in_the_kernel_causally(kernels, seed):
    """Decode rows, fresh prompts and chunks with cached context in one step, each token of a
    chunk attending to its own causal prefix (the reference: SDPA with the chunk's mask)."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(7):
        n = rng.choice([1, 1, 1, rng.randint(2, 40)])
        shapes.append((n, n + rng.choice([0, rng.randint(1, 50)])))
    got, want, plan = _both(shapes, 6, 2, 32, 4, seed)
    assert plan.kernel_rows.rows.numel() == sum(n for n, _ in shapes) and not plan.chunks  # no SDPA
    positions = [p for n, s in shapes for p in range(s - n, s)]
    assert plan.kernel_rows.key_end.tolist() == [p + 1 for p in positions]
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_long_chunks_go_to_sdpa_and_the_rest_to_the_kernel(kernels, monkeypatch):
    monkeypatch.setattr(cpu_attention, "SDPA_MIN_CHUNK", 8)
    shapes = [(1, 9), (12, 30), (7, 7), (9, 9), (1, 20)]  # a cached-context and a fresh chunk
    got, want, plan = _both(shapes, 6, 2, 32, 4, 3)
    assert [(c.start, c.end) for c in plan.chunks] == [(1, 13), (20, 29)]
    assert plan.kernel_rows.rows.tolist() == [0, *range(13, 20), 29]
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_key_begin_bounds_each_row_from_below(kernels):
    """The kernel's lower key bound (a sliding window's first key) against SDPA on the slice."""
    q, _, _, cache, meta = _batch([(1, 40), (1, 13)], 8, 2, 64, 16, 5)
    rows, batch = torch.arange(2), torch.arange(2)
    key_end = meta.seq_lens.clone()
    key_begin = torch.tensor([25, 0], dtype=torch.int32)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    q = q.contiguous()
    checked = kernels.attention_rows(meta.block_tables, rows, batch, key_end, 40, key_begin)
    kernels.paged_attention(q, out, cache, checked, 0.125)
    for i, (lo, hi) in enumerate([(25, 40), (0, 13)]):
        table = meta.block_tables[i].long()
        kv = cache[:, table].flatten(1, 2)[:, lo:hi]  # [2, keys, Hkv, D]
        k, v = (x.transpose(0, 1)[None] for x in kv)
        want = F.scaled_dot_product_attention(
            q[i].unsqueeze(1)[None], k, v, scale=0.125, enable_gqa=True
        )
        torch.testing.assert_close(out[i], want[0, :, 0], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "quant"), [(torch.bfloat16, False), (torch.float32, True)])
def test_caches_the_kernel_does_not_read_run_the_torch_reference(dtype, quant):
    got, want, plan = _both([(1, 9), (4, 12), (1, 3)], 4, 2, 16, 4, 1, dtype=dtype, quant=quant)
    assert not isinstance(plan, _CpuPlan)  # the reference's own plan
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_kernel_rejects_inputs_it_cannot_read(kernels):
    q, _, _, cache, meta = _batch([(1, 5), (1, 8)], 4, 2, 16, 4, 0)
    rows = batch = torch.arange(2)
    out = torch.empty(2, 4, 16)
    checked = kernels.attention_rows(meta.block_tables, rows, batch, meta.seq_lens, 8)
    with pytest.raises(ValueError, match="float32 q and a float32 or bfloat16 cache"):
        kernels.paged_attention(q.double(), out, cache, checked, 0.25)
    with pytest.raises(ValueError, match="float32 q and a float32 or bfloat16 cache"):
        kernels.paged_attention(q, out, cache.half(), checked, 0.25)
    with pytest.raises(ValueError, match="contiguous heads"):
        q_t = q.transpose(0, 1).contiguous().transpose(0, 1)
        kernels.paged_attention(q_t, out, cache, checked, 0.25)
    with pytest.raises(ValueError, match="int32"):
        kernels.attention_rows(meta.block_tables.long(), rows, batch, meta.seq_lens, 8)
    with pytest.raises(ValueError, match="one contiguous entry a row"):
        kernels.attention_rows(meta.block_tables, rows, batch[:1], meta.seq_lens, 8)
    with pytest.raises(ValueError, match="shapes do not fit"):
        kernels.paged_attention(q, torch.empty(2, 4, 8), cache, checked, 0.25)
    with pytest.raises(ValueError, match="longer than 7"):  # would overrun the work buffers
        short = kernels.attention_rows(meta.block_tables, rows, batch, meta.seq_lens, 7)
        kernels.paged_attention(q, out, cache, short, 1)
    with pytest.raises(ValueError, match="key range is empty"):
        begin = meta.seq_lens.clone()
        empty = kernels.attention_rows(meta.block_tables, rows, batch, meta.seq_lens, 8, begin)
        kernels.paged_attention(q, out, cache, empty, 0.25)
    k = v = torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match=r"new k must be float32 \[2, 2, 16\]"):
        kernels.paged_attention(q, out, cache, checked, 0.25, (k[:1], v, meta.slot_mapping))
    with pytest.raises(ValueError, match="new v needs contiguous heads"):
        v_t = v.transpose(1, 2).contiguous().transpose(1, 2)
        kernels.paged_attention(q, out, cache, checked, 0.25, (k, v_t, meta.slot_mapping))
    num_slots = cache.shape[1] * cache.shape[2]
    for bad in (-1, num_slots):
        slots = torch.tensor([0, bad])
        before = cache.clone()
        with pytest.raises(ValueError, match=rf"slot is outside \[0, {num_slots}\)"):
            kernels.paged_attention(q, out, cache, checked, 0.25, (k, v, slots))
        assert torch.equal(cache.view(2, -1, 2, 16)[:, 0], torch.stack([k[0], v[0]]))
        assert torch.equal(cache.view(2, -1, 2, 16)[:, 1:], before.view(2, -1, 2, 16)[:, 1:])


def test_the_kernel_writes_new_kv_when_every_chunk_goes_to_sdpa(kernels, monkeypatch):
    monkeypatch.setattr(cpu_attention, "SDPA_MIN_CHUNK", 1)
    got, want, plan = _both([(3, 9), (5, 5)], 4, 2, 16, 4, 2)
    assert plan.kernel_rows.rows.numel() == 0 and len(plan.chunks) == 2
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_without_a_compiler_the_backend_warns_once_and_runs_the_reference(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError, match="no-such-cc"):
        cpu_build.build()
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(RuntimeError, match="failed"):
        cpu_build.build()
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="conveyor.model.cpu.cpu_kernels"):
            backend = CpuAttentionBackend(CPU)
        assert "CPU C kernels unavailable" in caplog.text
        q, k, v, cache, meta = _batch([(1, 6), (3, 9)], 4, 2, 16, 4, 2)
        got = backend.forward(q, k, v, cache, meta, 0.25)
        meta.backend_state = None
        torch.testing.assert_close(got, reference(q, k, v, cache, meta, 0.25), atol=0, rtol=0)
    finally:
        cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("rows", [1, 16, 300])  # 300 x 768 takes the multi-threaded path
def test_fused_rms_norm_matches_torch(kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(2, rows, 768, generator=gen)
    fused, plain = RMSNorm(768, eps=1e-5), RMSNorm(768, eps=1e-5)
    with torch.no_grad():
        fused.weight.copy_(torch.randn(768, generator=gen))
        plain.weight.copy_(fused.weight)
    use_kernels(fused, kernels)
    want_x, want_sum = plain(x, residual)
    got_x, got_sum = fused(x.clone(), residual.clone())
    torch.testing.assert_close(got_sum, want_sum, atol=0, rtol=0)  # the add is exact
    torch.testing.assert_close(got_x, want_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused(x), plain(x), atol=1e-5, rtol=1e-5)
    # A view with a row stride (a slice of a wider activation) reads the right rows.
    wide = torch.randn(rows, 1024, generator=gen)
    torch.testing.assert_close(fused(wide[:, :768]), plain(wide[:, :768]), atol=1e-5, rtol=1e-5)


def test_norms_the_kernel_cannot_take_stay_in_torch(kernels):
    norm = RMSNorm(16)
    use_kernels(norm, kernels)
    heads = torch.randn(3, 4, 16)  # Qwen3's per-head q/k norm: 3-d
    torch.testing.assert_close(norm(heads), RMSNorm(16)(heads), atol=0, rtol=0)
    half = torch.randn(3, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(norm(half), RMSNorm(16)(half), atol=0, rtol=0)


@pytest.mark.parametrize(("backend", "fused"), [("auto", True), ("cpu", True), ("torch", False)])
def test_the_runner_uses_the_c_kernels_with_the_cpu_backend_only(kernels, backend, fused):
    from conveyor.config import EngineConfig
    from conveyor.model.runner import ModelRunner

    config = EngineConfig(attention_backend=backend, num_kv_blocks=8, max_model_len=64)
    runner = ModelRunner(config)
    kinds = (RMSNorm, RotaryEmbedding, GatedMLP)
    mods = [m for m in runner.model.modules() if isinstance(m, kinds)]
    assert {type(m) for m in mods} == set(kinds)
    assert all((m.kernels is not None) == fused for m in mods)
    # ... and the sampler's argmax (torch's with the "torch" backend)
    loaded = getattr(runner.sampler.argmax, "__self__", None)
    assert isinstance(loaded, cpu_kernels.CpuKernels) == fused


def test_rotary_in_place_matches_apply_rotary(kernels):
    gen = torch.Generator().manual_seed(3)
    emb = RotaryEmbedding(64, 512, 10000.0)
    positions = torch.tensor([0, 5, 511, 17, 300, 2])
    qkv = torch.randn(6, (8 + 2 * 2) * 64, generator=gen)
    qk = qkv[:, : 10 * 64].view(6, 10, 64)  # q and k heads of a qkv row, v left alone
    cos, sin = emb(positions)
    want, v_before = apply_rotary(qk, cos, sin), qkv[:, 10 * 64 :].clone()
    use_kernels(emb, kernels)
    got = emb.step(positions)(qk)
    assert got.data_ptr() == qkv.data_ptr()  # rotated where the projection wrote it
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 10 * 64 :], v_before)
    with pytest.raises(ValueError, match="outside the rotary table"):
        emb.step(torch.tensor([0, 1, 2, 3, 4, 512]))(qk)
    rotate = kernels.rotary_step(positions, emb.cos_sin_cache)
    with pytest.raises(ValueError, match=r"rotary needs float32 \[6, H, 64\]"):
        rotate(qk[:3])
    # A layout the kernel cannot take (heads not contiguous) goes through apply_rotary.
    strided = torch.randn(64, 6, 10, generator=gen).permute(1, 2, 0)
    torch.testing.assert_close(emb.step(positions)(strided), apply_rotary(strided, cos, sin))


# 300 x 2048 takes the multi-threaded path; 13 leaves a tail past the 8-wide vector loop.
@pytest.mark.parametrize(("rows", "inter"), [(1, 8), (3, 13), (16, 1536), (300, 2048)])
def test_silu_mul_matches_torch(kernels, rows, inter):
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 8
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])[: min(3, inter)]  # saturated, zero
    fused, plain = GatedMLP(16, inter), GatedMLP(16, inter)
    plain.load_state_dict(fused.state_dict())
    use_kernels(fused, kernels)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    x = torch.randn(rows, 16, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x), atol=1e-5, rtol=1e-5)
        # bf16 (and any layout the kernel cannot take) stays in torch
        fused.bfloat16(), plain.bfloat16()
        assert torch.equal(fused(x.bfloat16()), plain(x.bfloat16()))


def _argmax_cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    cases = [torch.randn(r, c, generator=gen) for r, c in [(1, 1), (1, 7), (3, 15), (3, 16)]]
    cases += [torch.randn(5, 17, generator=gen), torch.randn(16, 49152, generator=gen)]
    ties = torch.zeros(6, 40)  # the maximum at several places: lanes, the tail, index 0
    ties[0, [3, 11, 19]] = 1.0
    ties[1, [37, 38]] = 1.0  # only in the tail past the vector loop
    ties[2, [9, 1]] = 1.0  # two lanes, the later lane holds the smaller index
    ties[3] = float("-inf")  # all -inf: index 0, as torch
    ties[4, [5, 30]] = float("inf")
    ties[5] = -1.0
    ties[5, 7], ties[5, 12] = -0.0, 0.0  # -0.0 == 0.0: the first one wins
    nans = torch.randn(5, 40, generator=gen)
    nans[0, 20], nans[1, 38], nans[2, 0] = float("nan"), float("nan"), float("nan")
    nans[3, [10, 30]] = float("nan")  # the first NaN wins
    nans[4, 39] = float("nan")
    wide = torch.randn(4, 100, generator=gen)
    cases += [ties, nans, wide[:, 3:90], torch.randn(0, 9), torch.randn(300, 512, generator=gen)]
    return cases


def test_argmax_matches_torch_first_maximum_nan_and_layouts(kernels):
    for x in _argmax_cases():
        got = kernels.argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), x.shape
    # What the C loop cannot read goes to torch's argmax, with the same answer.
    gen = torch.Generator().manual_seed(6)
    for x in (torch.randn(50, 6, generator=gen).t(), torch.randn(3, 70).bfloat16()):
        assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))


def test_nonfinite_rows_finds_nan_and_infinities_anywhere_and_nothing_else(kernels):
    from conveyor.model.sampling.logits_guard import _torch_nonfinite_rows

    gen = torch.Generator().manual_seed(8)
    for rows, cols in ((1, 49152), (5, 37), (70, 1000)):  # 70 x 1000: the threads share rows
        x = torch.randn(rows, cols, generator=gen)
        assert kernels.nonfinite_rows(x) == []
        want = []
        values = (float("nan"), float("inf"), float("-inf")) * 40
        for r, value in zip(range(0, rows, 2), values, strict=False):
            x[r, (r * 7919) % cols] = value  # anywhere in the row
            want.append(r)
        if rows > 1:
            x[1, :] = 3e38  # finite, though a sum of the row overflows
        assert kernels.nonfinite_rows(x) == want == _torch_nonfinite_rows(x), (rows, cols)
    # What the C loop cannot read goes to torch, with the same answer.
    x = torch.randn(6, 50, generator=gen)
    x[2, 3] = float("nan")
    assert kernels.nonfinite_rows(x.t().contiguous().t()) == [2]
    assert kernels.nonfinite_rows(x.bfloat16()) == [2]


def test_sampler_with_the_c_argmax_draws_the_same_tokens(kernels):
    from conveyor.core.sequence import Sequence
    from conveyor.model.sampling.sampler import Sampler
    from conveyor.sampling_params import SamplingParams

    logits = torch.randn(12, 3000, generator=torch.Generator().manual_seed(7)) * 3
    logits[0, [5, 2999]] = 100.0  # a greedy tie
    temps = [0.0, 0.0, 0.7, 1.0, 0.0, 1.3, 0.0, 0.9, 1.0, 0.0, 2.0, 0.5]
    requests = [
        Sequence(f"r{i}", [1, 2], SamplingParams(temperature=t, seed=i if i % 3 else None), 64)
        for i, t in enumerate(temps)
    ]
    fast, plain = Sampler(3000, seed=1, argmax=kernels.argmax), Sampler(3000, seed=1)
    for _ in range(3):
        assert fast(logits, requests).token_ids == plain(logits, requests).token_ids
    greedy = [r for r, t in zip(requests, temps, strict=True) if t == 0.0]
    rows = logits[[i for i, t in enumerate(temps) if t == 0.0]]
    assert fast(rows, greedy).token_ids == rows.argmax(dim=-1).tolist()

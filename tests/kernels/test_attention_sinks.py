"""Attention sinks (gpt-oss: a logit per query head in the softmax's denominator only) in
every backend, against a dense float64 softmax with the sink as one more column: the torch
reference (decode groups and SDPA chunks), the CPU C kernel (its AVX2 and generic tasks, a
float32 and a bfloat16 cache, with and without a window; long chunks through SDPA) and the
Triton kernel (compiled on a GPU, else in the interpreter; one key split and several)."""

from __future__ import annotations

import pytest
import torch
from tests.model.paged_blocks import shuffled_block_tables

from conveyor.model.attention import cpu_attention
from conveyor.model.attention.cpu_attention import CpuAttentionBackend, _CpuPlan
from conveyor.model.attention.metadata import build_attention_metadata
from conveyor.model.attention.torch_attention import TorchAttentionBackend
from conveyor.model.kv_cache import write_kv_cache

CPU = torch.device("cpu")
# decode rows (one a fresh one-token prompt) and prefill chunks with and without history
SHAPES = [(1, 9), (6, 30), (1, 1), (3, 3), (1, 23), (7, 12)]


def _batch(shapes, hq, hkv, d, bs, seed, kv_dtype=torch.float32):
    """A paged cache (shuffled blocks) holding each request's history, this step's q, k, v,
    and sinks with one far above every score (the max is the sink's)."""
    gen = torch.Generator().manual_seed(seed)
    tables = shuffled_block_tables([s for _, s in shapes], bs, seed)
    cache = torch.zeros(2, sum(map(len, tables)) + 1, bs, hkv, d, dtype=kv_dtype)
    for (n, s), table in zip(shapes, tables, strict=True):
        if s > n:
            hist = build_attention_metadata([s - n], [s - n], [table], bs)
            write_kv_cache(*torch.randn(2, s - n, hkv, d, generator=gen), cache, hist.slot_mapping)
    meta = build_attention_metadata([n for n, _ in shapes], [s for _, s in shapes], tables, bs)
    t = sum(n for n, _ in shapes)
    q = torch.randn(t, hq, d, generator=gen)
    k, v = torch.randn(2, t, hkv, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) * 2
    sinks[0] = 30.0
    return q, k, v, cache, meta, sinks


def _dense(q, cache, meta, scale, window, sinks):
    """Each new token against its context as the cache holds it (after the call), in float64."""
    _, _, bs, hkv, d = cache.shape
    g = q.shape[1] // hkv
    flat = cache.double().view(2, -1, hkv, d)
    out, row = torch.empty(q.shape, dtype=torch.float64), 0
    for b, (n, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        pos = torch.arange(s)
        slots = meta.block_tables[b].long()[pos // bs] * bs + pos % bs
        k, v = (x.repeat_interleave(g, 1) for x in (flat[0, slots], flat[1, slots]))
        for i in range(n):
            p = s - n + i
            lo = 0 if window is None else max(0, p - window + 1)
            scores = torch.einsum("hd,lhd->hl", q[row + i].double(), k[lo : p + 1]) * scale
            probs = torch.cat([scores, sinks.double()[:, None]], 1).softmax(-1)[:, :-1]
            out[row + i] = torch.einsum("hl,lhd->hd", probs, v[lo : p + 1])
        row += n
    return out.view(q.shape[0], -1)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 12])  # the AVX2 task and the generic loop
def test_the_c_kernel_puts_the_sink_in_the_denominator(kernels, d, kv_dtype, window):
    q, k, v, cache, meta, sinks = _batch(SHAPES, 6, 2, d, 4, seed=d, kv_dtype=kv_dtype)
    got = CpuAttentionBackend(CPU).forward(q, k, v, cache, meta, d**-0.5, window, sinks)
    (plan,) = meta.backend_state.values()
    assert isinstance(plan, _CpuPlan) and plan.kernel_rows.rows.numel() == q.shape[0]
    want = _dense(q, cache, meta, d**-0.5, window, sinks)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    # without sinks the same call is another result: the sinks were read
    meta.backend_state = None
    plain = CpuAttentionBackend(CPU).forward(q, k, v, cache, meta, d**-0.5, window)
    assert (plain - got).abs().max() > 1e-2


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sdpa_chunks", [False, True])
def test_the_torch_reference_and_the_cpu_backends_sdpa_chunks(monkeypatch, window, sdpa_chunks):
    q, k, v, cache, meta, sinks = _batch(SHAPES, 8, 2, 16, 4, seed=3)
    if sdpa_chunks:  # the cpu backend's chunks of 3 tokens or more go to SDPA
        monkeypatch.setattr(cpu_attention, "SDPA_MIN_CHUNK", 3)
        backend = CpuAttentionBackend(CPU)
    else:
        backend = TorchAttentionBackend(CPU)
    got = backend.forward(q, k, v, cache, meta, 0.25, window, sinks)
    torch.testing.assert_close(got.double(), _dense(q, cache, meta, 0.25, window, sinks),
                               atol=2e-6, rtol=1e-5)  # fmt: skip


def test_the_c_kernel_checks_the_sinks(kernels):
    q, _, _, cache, meta, sinks = _batch([(1, 5)], 4, 2, 16, 4, seed=1)
    rows = kernels.attention_rows(
        meta.block_tables, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
        meta.seq_lens, 5,
    )  # fmt: skip
    for bad in (sinks.double(), sinks[:3], torch.zeros(8)[::2]):
        with pytest.raises(ValueError, match="sinks must be a contiguous float32"):
            kernels.paged_attention(q, torch.empty_like(q), cache, rows, 0.25, sinks=bad)


def test_a_backend_without_sinks_refuses_a_model_with_them():
    class NoSinks(TorchAttentionBackend):
        name = "no-sinks"
        supports_sinks = False

    NoSinks.check_supports("auto", True)  # a model without sinks runs
    with pytest.raises(ValueError, match="'no-sinks' cannot run attention sinks"):
        NoSinks.check_supports("auto", True, sinks=True)


@pytest.mark.interpreter
@pytest.mark.parametrize(("window", "splits"), [(None, 1), (5, 1), (None, 2)])
def test_the_triton_kernel_puts_the_sink_in_the_denominator(window, splits, triton_device):
    import conveyor.kernels.launchers as triton_kernels

    device = torch.device(triton_device)
    shapes = [(1, 9), (6, 30), (3, 3)] if splits == 1 else [(1, 40), (1, 17)]
    q, k, v, cache, meta, sinks = _batch(shapes, 4, 2, 16, 8, seed=5)
    write_kv_cache(k, v, cache, meta.slot_mapping)
    dev = build_attention_metadata(
        meta.query_lens_cpu, meta.seq_lens_cpu, meta.block_tables.tolist(), 8, device
    )
    out = triton_kernels.paged_attention(
        q.to(device), cache.to(device), dev.block_tables, dev.seq_lens, dev.query_start_loc,
        0.25, meta.max_query_len, meta.max_seq_len, num_splits=splits, window=window,
        sinks=sinks.to(device),
    )  # fmt: skip
    want = _dense(q, cache, meta, 0.25, window, sinks)
    torch.testing.assert_close(out.view(q.shape[0], -1).cpu().double(), want, atol=2e-5, rtol=0)

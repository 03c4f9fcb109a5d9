"""Sliding-window attention: served past the window, with the model's own answers.

A layer with window W lets the token at position p see keys p - W + 1 .. p, as transformers'
`sliding_window_overlay` does (checked below: its eager and sdpa attention apply the window
for these configs, so the reference is not full attention). Greedy tokens of prompts and
outputs well past a window of 16 equal transformers' on the torch and cpu backends, through
chunked prefill whose chunks cross the window edge and through prefix-cache hits. The kernels
get the same window against a dense masked reference: the torch backend, the C decode kernel
and (in Triton's interpreter, or compiled on a GPU) the Triton kernel.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from tests.hf_checkpoints import greedy_reference, write_checkpoint
from tests.model.paged_blocks import shuffled_block_tables

from conveyor import LLM, SamplingParams
from conveyor.model.attention.cpu_attention import CpuAttentionBackend, _CpuPlan
from conveyor.model.attention.metadata import build_attention_metadata
from conveyor.model.attention.torch_attention import paged_attention
from conveyor.model.kv_cache import write_kv_cache
from conveyor.model.loading.model_config import ModelConfig

WINDOW = 16
CPU = torch.device("cpu")


def _batch(shapes, hq, hkv, d, bs, seed):
    """A paged cache (shuffled blocks) holding each request's whole context, this step's q,
    and the dense per-request K/V. shapes: (new tokens, context after this step)."""
    gen = torch.Generator().manual_seed(seed)
    tables = shuffled_block_tables([s for _, s in shapes], bs, seed)
    cache = torch.zeros(2, sum(map(len, tables)) + 1, bs, hkv, d)
    seqs = [s for _, s in shapes]
    kv = [torch.randn(2, s, hkv, d, generator=gen) for s in seqs]
    everything = build_attention_metadata(seqs, seqs, tables, bs)
    write_kv_cache(*torch.cat(kv, 1).unbind(0), cache, everything.slot_mapping)
    meta = build_attention_metadata([n for n, _ in shapes], seqs, tables, bs)
    q = torch.randn(sum(n for n, _ in shapes), hq, d, generator=gen)
    new_k = torch.cat([x[0, s - n :] for x, (n, s) in zip(kv, shapes, strict=True)])
    new_v = torch.cat([x[1, s - n :] for x, (n, s) in zip(kv, shapes, strict=True)])
    return q, new_k, new_v, cache, meta, kv


def _dense(q, kv, shapes, window, scale):
    """Each new token of each request against its own dense context, masked by position."""
    out, row = [], 0
    for x, (n, s) in zip(kv, shapes, strict=True):
        pos = torch.arange(s - n, s)[:, None]
        keys = torch.arange(s)[None, :]
        allowed = (keys <= pos) & (keys > pos - window)
        qh = q[row : row + n].transpose(0, 1)  # [Hq, n, D]
        k, v = (t.transpose(0, 1) for t in x)  # [Hkv, s, D]
        g = qh.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        scores = (qh @ k.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1))
        row += n
    return torch.cat(out)


# Decodes before, at and past the window; fresh prompts shorter and longer than it; chunks
# with cached context that start before, at and past the window edge.
SHAPES = [(1, 5), (1, 16), (1, 17), (1, 41), (9, 9), (30, 30), (6, 14), (8, 22), (12, 50)]


@pytest.mark.parametrize("window", [1, 5, WINDOW])
def test_torch_and_cpu_backends_apply_the_window_like_a_dense_mask(window):
    q, k, v, cache, meta, kv = _batch(SHAPES, 6, 2, 32, 4, seed=window)
    want = _dense(q, kv, SHAPES, window, 32**-0.5)
    got = paged_attention(q, k, v, cache, meta, 32**-0.5, window)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # The same step's full-attention layers keep their own plan and answer.
    full = paged_attention(q, k, v, cache, meta, 32**-0.5)
    torch.testing.assert_close(full, _dense(q, kv, SHAPES, 10**9, 32**-0.5), atol=2e-6, rtol=0)
    backend = CpuAttentionBackend(CPU)
    meta.backend_state = None
    got_cpu = backend.forward(q, k, v, cache, meta, 32**-0.5, window)
    if backend._kernels is not None:  # the C kernel ran the decode rows
        assert any(isinstance(p, _CpuPlan) for p in meta.backend_state.values())
    torch.testing.assert_close(got_cpu, want, atol=2e-6, rtol=1e-5)


@pytest.mark.interpreter
def test_triton_kernel_applies_the_window():
    import conveyor.kernels.launchers as kernels

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not kernels.INTERPRETED:
        pytest.skip("no GPU and TRITON_INTERPRET was not set when conveyor.kernels loaded")
    # One interpreted fp32 launch: decodes past the window, a fresh prompt longer than it and
    # a chunk with cached context crossing its edge, split 2 ways (a split may see no key).
    shapes = [(1, 40), (1, 9), (20, 20), (5, 27)]
    q, _, _, cache, meta, kv = _batch(shapes, 4, 2, 16, 8, seed=3)
    out = kernels.paged_attention(
        q.to(dev), cache.to(dev), meta.block_tables.to(dev), meta.seq_lens.to(dev),
        meta.query_start_loc.to(dev), 0.25, meta.max_query_len, meta.max_seq_len,
        num_splits=2, window=WINDOW,
    )  # fmt: skip
    want = _dense(q, kv, shapes, WINDOW, 0.25)
    torch.testing.assert_close(out.view(q.shape[0], -1).cpu(), want, atol=2e-5, rtol=1e-5)


# Qwen2 with the window on layers 1 and 2 only (max_window_layers=1 of 3 layers).
MODELS = {
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2": (
        "qwen2",
        dict(
            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, num_hidden_layers=3
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def windowed(request, tmp_path_factory, tiny_tokenizer_dir):
    family, overrides = MODELS[request.param]
    path = write_checkpoint(
        tmp_path_factory.mktemp(request.param), family, tiny_tokenizer_dir, **overrides
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return request.param, path, hf


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(vocab) for _ in range(24)]  # 3 blocks of 8: a cacheable prefix
    return [
        [rng.randrange(vocab) for _ in range(5)],  # decodes far past the window
        [rng.randrange(vocab) for _ in range(40)],
        shared + [rng.randrange(vocab) for _ in range(9)],
        shared + [rng.randrange(vocab) for _ in range(13)],  # a prefix-cache hit on `shared`
    ]


def test_transformers_applies_the_window_in_eager_and_sdpa(windowed):
    name, path, hf = windowed
    ids = torch.tensor([_prompts(hf.config.vocab_size)[1]])
    assert hf.config.sliding_window == WINDOW
    unwindowed_config = {"sliding_window": None}
    if name == "qwen2":
        assert hf.config.layer_types == ["full_attention"] + ["sliding_attention"] * 2
        unwindowed_config = {"layer_types": ["full_attention"] * 3}
    logits = {}
    for impl in ("eager", "sdpa"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=impl
        )
        full = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=impl, **unwindowed_config
        )
        with torch.no_grad():
            logits[impl] = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
            unwindowed = full(ids, attention_mask=torch.ones_like(ids)).logits[0]
        # Within the window the two agree; past it the window changes the answer.
        torch.testing.assert_close(logits[impl][:WINDOW], unwindowed[:WINDOW])
        assert (logits[impl][WINDOW:] - unwindowed[WINDOW:]).abs().max() > 1e-3
    torch.testing.assert_close(logits["eager"], logits["sdpa"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_past_the_window_equal_transformers(windowed, backend):
    _, path, hf = windowed
    prompts = _prompts(hf.config.vocab_size)
    max_tokens = [40, 20, 20, 20]
    want = greedy_reference(hf, prompts, max_tokens)
    assert min(len(p) + len(w) for p, w in zip(prompts, want, strict=True)) > 2 * WINDOW
    # Chunks of at most 7 tokens cross the window edge at every offset; block size 8 makes
    # the shared 24-token prefix three cacheable blocks.
    llm = LLM(str(path), attention_backend=backend, block_size=8, num_kv_blocks=64,
              max_num_batched_tokens=7, enable_prefix_caching=True)  # fmt: skip
    assert llm.llm_engine.max_model_len == hf.config.max_position_embeddings  # no cap
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    first = llm.generate(prompts[:3], params[:3], use_tqdm=False)
    hit = llm.generate(prompts[3:], params[3:], use_tqdm=False)
    assert hit[0].num_cached_tokens == 24
    assert [o.outputs[0].token_ids for o in first + hit] == want


def _windows(**hf):
    base = dict(architectures=["X"], vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=4, num_attention_heads=2, sliding_window=WINDOW)  # fmt: skip
    return ModelConfig.from_hf_config({**base, **hf}).layer_windows


def test_which_layers_use_a_window_follows_the_config():
    w, n = WINDOW, None
    assert _windows() == (w, w, w, w)  # Mistral: every layer
    assert _windows(sliding_window=None) == (n, n, n, n)
    # Qwen2/3: behind use_sliding_window, from layer max_window_layers on.
    assert _windows(use_sliding_window=False, max_window_layers=0) == (n, n, n, n)
    assert _windows(use_sliding_window=True, max_window_layers=2) == (n, n, w, w)
    assert _windows(use_sliding_window=True, max_window_layers=4) == (n, n, n, n)
    # transformers 5's per-layer list wins (Gemma-style alternation included).
    full, sliding = "full_attention", "sliding_attention"
    assert _windows(use_sliding_window=True, layer_types=[full] * 4) == (n, n, n, n)
    assert _windows(layer_types=[sliding, full, sliding, full]) == (w, n, w, n)
    assert _windows(use_sliding_window=False, layer_types=[sliding] * 4) == (n, n, n, n)
    with pytest.raises(ValueError, match="'full_attention' or 'sliding_attention' for each"):
        _windows(layer_types=["chunked_attention"] * 4)

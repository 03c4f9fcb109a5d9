"""CUDA graphs for decode steps (model/decode_graphs.py).

Without a GPU the graphs cannot be captured, but everything around them runs: the persistent
buffers, the staging copy, the padding rows of a batch between two capture sizes, and the
runner's choice of graph or eager path. `DecodeGraphs(capture=False)` runs the forward on those
buffers at each "replay", through the Triton kernels in Triton's interpreter, and must give the
eager path's greedy tokens. On a GPU (the `cuda` tests, skipped here) the graphs are captured
and replayed for real, against `enforce_eager=True`, and the KV cache is sized from the
device's free memory.
"""

from __future__ import annotations

import gc

import pytest
import torch
from tests.hf_checkpoints import write_checkpoint
from tests.logprobs_close import check_logprobs_close

from conveyor import LLM, SamplingParams
from conveyor.model.decode_graphs import DecodeGraphs, capture_sizes

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# Five prompts, outputs of different lengths: the decode batch shrinks 5 -> 1, so steps replay
# sizes 8 (3 padding rows), 4 (padding) and 2, 1.
PROMPTS = [[(11 * i + 5 * n) % 400 + 20 for i in range(n)] for n in (9, 23, 4, 17, 12)]
MAX_TOKENS = [6, 3, 8, 5, 2]


def test_capture_sizes_cover_every_batch_with_little_padding():
    for max_num_seqs in (1, 3, 8, 13, 64, 256):
        sizes = capture_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
        for batch in range(1, max_num_seqs + 1):
            size = next(s for s in sizes if s >= batch)
            assert size - batch < max(8, batch // 2 + 1)
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and len(capture_sizes(256)) == 35


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, demo_model_dir):
    import conveyor.kernels.launchers as kernels

    if not CUDA and not kernels.INTERPRETED:
        pytest.skip("no GPU and TRITON_INTERPRET was not set when conveyor.kernels loaded")
    return write_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", demo_model_dir)


def _llm(path, **kwargs) -> LLM:
    kwargs = {
        "attention_backend": "triton",
        "device": DEVICE,
        "dtype": "float32",
        "block_size": 16,
        "num_kv_blocks": 32,
        "max_num_seqs": 8,
        **kwargs,
    }
    return LLM(str(path), **kwargs)


def _run(llm: LLM, logprobs: int | None = None):
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=logprobs)
        for m in MAX_TOKENS
    ]
    return llm.generate(PROMPTS, params, use_tqdm=False)


def _count_replays(graphs: DecodeGraphs) -> list[int]:
    """Record the batch size of every graph run."""
    batches: list[int] = []
    run = graphs.run

    def counted(token_ids, seq_lens, tables):
        batches.append(len(token_ids))
        return run(token_ids, seq_lens, tables)

    graphs.run = counted
    return batches


@pytest.mark.interpreter
def test_graph_buffers_and_padding_give_the_eager_tokens(checkpoint):
    """The graph path's inputs (staging copy, padding rows, slot -1, fixed key splits) give
    the eager path's greedy tokens; decode steps take it, prefill steps do not."""
    eager = _llm(checkpoint, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in _run(eager)]
    del eager
    llm = _llm(checkpoint)
    runner = llm.llm_engine.runner
    if not CUDA:  # what start-up does on CUDA, with the forward run eagerly at each replay
        assert runner.graphs is None
        runner.graphs = DecodeGraphs(
            runner.model, runner.kv_caches, 8, runner.max_model_len, runner.block_size,
            runner.device, capture=False,
        )  # fmt: skip
    batches = _count_replays(runner.graphs)
    got = [o.outputs[0].token_ids for o in _run(llm)]
    assert got == want
    assert [len(t) for t in got] == MAX_TOKENS
    # Decode steps of 5, 4, 3, 2, 1 requests ran on the graphs (3 of them padded).
    assert set(batches) >= {1, 2, 3, 5}, batches
    assert sum(batches) == sum(MAX_TOKENS) - len(PROMPTS)  # every token but the first


@pytest.mark.interpreter
def test_a_forward_on_fresh_buffers_writes_no_kv(checkpoint):
    """Before any step every row is padding on the device too (slot -1), so the warm-up
    forward that precedes each capture leaves the KV cache as it was."""
    llm = _llm(checkpoint, enforce_eager=True)
    runner = llm.llm_engine.runner
    for cache in runner.kv_caches:
        cache.normal_()
    before = [cache.clone() for cache in runner.kv_caches]
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, 8, runner.max_model_len, runner.block_size,
        runner.device, capture=False,
    )  # fmt: skip
    graphs._forward(8)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))


def test_capture_off_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(torch.nn.Identity(), [], 4, 64, 16, torch.device("cpu"))


@needs_cuda
def test_cuda_graphs_are_captured_at_start_up_and_replayed(checkpoint):
    llm = _llm(checkpoint)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and sorted(graphs._graphs) == capture_sizes(8)
    assert _llm(checkpoint, enforce_eager=True).llm_engine.runner.graphs is None


@needs_cuda
def test_cuda_graphs_bf16_and_int8_match_eager_by_logprobs(checkpoint):
    """bf16 (and an int8 cache) are not bit-exact between a padded graph batch and an eager
    one (GEMM shapes differ), so vLLM's check_logprobs_close rule applies."""
    for kv in ("auto", "int8"):
        eager = _run(_llm(checkpoint, dtype="bfloat16", kv_cache_dtype=kv, enforce_eager=True), 5)
        llm = _llm(checkpoint, dtype="bfloat16", kv_cache_dtype=kv)
        batches = _count_replays(llm.llm_engine.runner.graphs)
        check_logprobs_close(_run(llm, 5), eager)
        assert batches


@needs_cuda
def test_kv_cache_is_sized_from_free_gpu_memory(tmp_path, demo_model_dir):
    """With no size given, the KV cache takes what gpu_memory_utilization leaves: the device's
    used memory after start-up is close to that share, and a smaller share gives fewer
    blocks. (Wide KV heads and a long context, so the cap of what max_num_seqs requests of
    max_model_len tokens can use stays above the share with a few hundred thousand blocks.)"""
    path = write_checkpoint(
        tmp_path, "qwen2", demo_model_dir, hidden_size=1024, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=131072,
    )  # fmt: skip
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    blocks = {}
    for util in (0.3, 0.6):
        llm = _llm(
            path, num_kv_blocks=None, gpu_memory_utilization=util, max_num_seqs=64,
            enforce_eager=True,
        )  # fmt: skip
        used = total - torch.cuda.mem_get_info()[0]
        blocks[util] = llm.llm_engine.runner.num_kv_blocks
        assert abs(used - util * total) < 2 * 2**30, (util, used, total)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert 1.8 < blocks[0.6] / blocks[0.3] < 2.2, blocks

"""Weights on 2 MiB pages (conveyor/model/cpu/huge_pages.py): the arena places them, the
loader puts the streamed weights there, the kernel backs them with huge pages, and the
output does not change."""

from __future__ import annotations

import gc
import itertools
import re
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from tests.gguf_files import write_gguf
from tests.hf_checkpoints import write_checkpoint

from conveyor import LLM, SamplingParams
from conveyor.model.cpu import huge_pages
from conveyor.model.cpu.huge_pages import ALIGN, ENV, arena_empty, huge_page_arena
from conveyor.model.cpu.linear import CpuLinear
from conveyor.model.cpu.quant_linear import QuantLinear
from conveyor.model.loading.loader import storage_bytes, weight_bytes

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not huge_pages.supported() or not _THP.exists(), reason="no transparent huge pages here"
)


def _advised_huge(ptr: int) -> bool:
    """Whether the mapping holding address `ptr` was advised MADV_HUGEPAGE (smaps' "hg")."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m[1], 16) <= ptr < int(m[2], 16)
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_the_arena_places_tensors_aligned_side_by_side_and_they_outlive_it(monkeypatch):
    with huge_page_arena(4 << 20) as arena:  # 4 MiB mappings
        small = [arena_empty((3, 5), torch.bfloat16) for _ in range(3)]
        big = arena_empty((arena.chunk_bytes // 4 + 1,), torch.float32)  # its own mapping
        after = arena_empty((16,), torch.uint8)
    del arena
    gc.collect()
    ptrs = [t.data_ptr() for t in small]
    assert all(p % ALIGN == 0 for p in ptrs)
    # 30 bytes each, the next on the next cache line of the same mapping
    assert [b - a for a, b in itertools.pairwise(ptrs)] == [ALIGN, ALIGN]
    assert after.data_ptr() == ptrs[-1] + ALIGN  # the big one did not close the chunk
    assert big.data_ptr() % 4096 == 0 and big.numel() == (1 << 20) + 1
    for i, t in enumerate(small):
        t.fill_(i)
    big.fill_(2.5)
    assert [float(t.sum()) for t in small] == [0.0, 15.0, 30.0] and float(big[-1]) == 2.5
    assert all(_advised_huge(t.data_ptr()) for t in (*small, big))
    # one byte counted once: side by side in one storage, each tensor's own bytes
    assert storage_bytes([*small, small[0], big]) == 3 * 30 + big.numel() * 4
    # outside the context: torch's own allocation, no mapping
    monkeypatch.setattr(huge_pages, "_mapping", None)
    assert arena_empty((1 << 20,), torch.float32).numel() == 1 << 20


@pytest.mark.skipif(
    not _THP.exists() or "[never]" in _THP.read_text(), reason="transparent huge pages off"
)
def test_weights_written_into_the_arena_sit_on_huge_pages():
    before = huge_pages.huge_page_bytes()
    with huge_page_arena():
        weights = [arena_empty((1 << 20,), torch.float32) for _ in range(16)]  # 64 MiB
    for w in weights:
        w.fill_(1.0)
    # all but the chunk's partial 2 MiB ends: at least 60 of the 64 MiB
    assert huge_pages.huge_page_bytes() - before >= 60 << 20


def _streamed_weights(llm: LLM) -> list[torch.Tensor]:
    model = llm.llm_engine.runner.model
    out = [m.packed_weight for m in model.modules() if isinstance(m, CpuLinear)]
    for m in model.modules():
        if isinstance(m, QuantLinear):
            out += [b for name, b in m.named_buffers() if name.startswith("qweight")]
    return out


def _run(model: str, monkeypatch, env: str, **kwargs) -> tuple[list[list[int]], list, list]:
    """The greedy tokens of a model loaded with $CONVEYOR_HUGE_PAGES=`env`; for each streamed
    weight and KV cache tensor, whether it lies in one of the arena's mappings, and whether
    its mapping was advised MADV_HUGEPAGE."""
    monkeypatch.setenv(ENV, env)
    mappings: list[tuple[int, int]] = []
    real_mapping = huge_pages._mapping

    def recorded(nbytes: int) -> torch.Tensor:
        region = real_mapping(nbytes)
        mappings.append((region.data_ptr(), nbytes))
        return region

    monkeypatch.setattr(huge_pages, "_mapping", recorded)
    llm = LLM(model, num_kv_blocks=32, **kwargs)
    monkeypatch.setattr(huge_pages, "_mapping", real_mapping)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate([[5, 9, 2, 7], [11, 3]], params, use_tqdm=False)
    weights = _streamed_weights(llm)
    caches = [  # the KV cache too
        t
        for c in llm.llm_engine.runner.kv_caches
        for t in ([c] if isinstance(c, torch.Tensor) else [c.data, c.scales])
    ]
    tensors = [*weights, *caches]
    in_arena = [any(a <= t.data_ptr() < a + n for a, n in mappings) for t in tensors]
    advised = [_advised_huge(t.data_ptr()) for t in tensors]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    assert weights and storage_bytes(weights) == nbytes  # not the arena's mapping sizes
    assert weight_bytes(llm.llm_engine.runner.model) < 64 << 20  # the small model's own
    return [o.outputs[0].token_ids for o in outs], in_arena, advised


def _check_on_and_off(model: str, monkeypatch, **kwargs) -> None:
    tokens, in_arena, advised = _run(model, monkeypatch, "1", **kwargs)
    assert in_arena and all(in_arena) and all(advised)
    # off: torch's own allocations (which may still sit where numpy once asked for huge
    # pages, so only the arena is checked)
    tokens_off, in_arena_off, _ = _run(model, monkeypatch, "0", **kwargs)
    assert not any(in_arena_off)
    assert tokens == tokens_off


@pytest.mark.parametrize(("dtype", "kv"), [("bfloat16", "auto"), ("float32", "int8")])
def test_a_loaded_models_linears_and_kv_cache_are_in_the_arena_and_give_the_same_tokens(
    demo_model_dir, kernels, monkeypatch, dtype, kv
):
    _check_on_and_off(str(demo_model_dir), monkeypatch, dtype=dtype, kv_cache_dtype=kv)


def test_a_gguf_files_kept_blocks_and_kv_cache_are_in_the_arena_and_give_the_same_tokens(
    tmp_path, tiny_tokenizer_dir, kernels, monkeypatch
):
    hf_dir = write_checkpoint(tmp_path / "hf", "llama", tiny_tokenizer_dir)
    file = write_gguf(hf_dir, tmp_path / "m.gguf", QType.Q8_0)
    _check_on_and_off(str(file), monkeypatch, dtype="float32")

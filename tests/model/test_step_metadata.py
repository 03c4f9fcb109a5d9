"""A step's attention metadata (conveyor.model.attention.metadata.build_step_metadata) against
a token-by-token reference, for decode-only steps (built in Python) and steps with prefill
chunks (built in numpy), on the CPU and through the one-copy path the GPU takes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.model.attention import metadata
from conveyor.model.attention.metadata import build_step_metadata

BLOCK = 4


@st.composite
def steps(draw, decode_only: bool) -> tuple:
    """(query_lens, seq_lens, block_tables, extra) of one step; each request's table has at
    least the blocks its context needs, from distinct ids, and may have more."""
    n = draw(st.integers(1, 6))
    ids = iter(draw(st.permutations(range(200))))
    query_lens, seq_lens, tables = [], [], []
    for _ in range(n):
        q = 1 if decode_only else draw(st.integers(1, 9))
        s = q + draw(st.integers(0, 20))
        blocks = -(-s // BLOCK) + draw(st.integers(0, 2))
        query_lens.append(q)
        seq_lens.append(s)
        tables.append([next(ids) for _ in range(blocks)])
    tokens = sum(query_lens)
    extra = ([draw(st.integers(0, 10**6)) for _ in range(tokens)], list(range(n)))
    return query_lens, seq_lens, tables, extra


def _reference(query_lens, seq_lens, tables) -> dict:
    positions, slots, starts = [], [], [0]
    for q, s, table in zip(query_lens, seq_lens, tables, strict=True):
        for p in range(s - q, s):
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        starts.append(starts[-1] + q)
    width = max(len(t) for t in tables)
    return {
        "positions": positions,
        "slot_mapping": slots,
        "query_start_loc": starts,
        "seq_lens": list(seq_lens),
        "block_tables": [t + [0] * (width - len(t)) for t in tables],
    }


def _check(meta, extras, step) -> None:
    query_lens, seq_lens, tables, extra = step
    for name, want in _reference(query_lens, seq_lens, tables).items():
        got = getattr(meta, name)
        dtype = torch.int64 if name in ("positions", "slot_mapping") else torch.int32
        assert got.dtype == dtype and got.is_contiguous(), name
        assert got.tolist() == want, name
    assert [x.tolist() for x in extras] == list(extra)
    assert all(x.dtype == torch.int64 for x in extras)
    assert (meta.max_query_len, meta.max_seq_len) == (max(query_lens), max(seq_lens))
    assert (meta.query_lens_cpu, meta.seq_lens_cpu) == (query_lens, seq_lens)


@settings(max_examples=150, deadline=None)
@given(step=st.one_of(steps(decode_only=True), steps(decode_only=False)))
def test_the_metadata_is_the_reference_token_by_token(step):
    query_lens, seq_lens, tables, extra = step
    meta, extras = build_step_metadata(query_lens, seq_lens, tables, BLOCK, "cpu", extra)
    _check(meta, extras, step)


@settings(max_examples=60, deadline=None)
@given(step=st.one_of(steps(decode_only=True), steps(decode_only=False)))
def test_the_one_copy_path_of_a_gpu_gives_the_same_metadata(step, copy_stood_in):
    """Off the CPU every part goes in one copy (host_copy.to_device_int64) and the int32 ones
    are cast after it. Without a GPU here, the copy is stood in for by CPU tensors of the same
    flat int64 buffer, and the device is torch's "meta" (no data): what is checked is the
    order and the casts of the parts."""
    query_lens, seq_lens, tables, extra = step
    meta, extras = build_step_metadata(query_lens, seq_lens, tables, BLOCK, "meta", extra)
    _check(meta, extras, step)


@pytest.fixture(scope="module")
def copy_stood_in():
    def host_copy(arrays, device):
        assert device.type != "cpu"
        flat = torch.cat([torch.from_numpy(a).reshape(-1).to(torch.int64) for a in arrays])
        sizes = [a.size for a in arrays]
        return [x.view(a.shape) for x, a in zip(flat.split(sizes), arrays, strict=True)]

    mp = pytest.MonkeyPatch()
    mp.setattr(metadata, "to_device_int64", host_copy)
    yield
    mp.undo()


def test_a_context_longer_than_its_table_is_refused():
    with pytest.raises(ValueError, match="bad request shape"):
        build_step_metadata([1], [9], [[0, 1]], BLOCK)

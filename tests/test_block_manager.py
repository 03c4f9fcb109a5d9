from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core.block_manager import BlockManager
from conveyor.core.sequence import Sequence
from conveyor.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int) -> Sequence:
    return Sequence(request_id, list(range(num_prompt_tokens)), SamplingParams(), max_tokens=16)


def check_invariants(bm: BlockManager) -> None:
    free = list(bm.free_block_queue)
    assert len(free) == len(set(free)), "a block is in the free queue twice"
    assert all(rc >= 0 for rc in bm.ref_counts)
    in_use = sum(1 for rc in bm.ref_counts if rc > 0)
    assert in_use + bm.num_free_blocks == bm.num_total_blocks
    assert all(bm.ref_counts[b] == 0 for b in free)
    # Without sharing, each held block belongs to exactly one table.
    held = [b for table in bm.block_tables.values() for b in table]
    assert len(held) == len(set(held)) == in_use
    assert all(bm.ref_counts[b] == 1 for b in held)


def test_allocate_covers_computed_plus_new_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request("a", 10)
    assert bm.allocate_slots(req, 10)
    assert bm.get_block_table("a") == [0, 1, 2]
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)


def test_allocate_only_adds_missing_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request("a", 10)
    assert bm.allocate_slots(req, 10)
    req.num_computed_tokens = 10
    assert bm.allocate_slots(req, 2)  # 12 tokens still fit in 3 blocks
    assert bm.get_block_table("a") == [0, 1, 2]
    req.num_computed_tokens = 12
    assert bm.allocate_slots(req, 1)
    assert bm.get_block_table("a") == [0, 1, 2, 3]
    assert bm.allocate_slots(req, 0)
    assert bm.num_free_blocks == 4


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate_slots(make_request("a", 12), 12)
    b = make_request("b", 8)
    assert not bm.allocate_slots(b, 8)
    assert bm.get_block_table("b") == []
    assert bm.num_free_blocks == 1
    assert bm.allocate_slots(b, 4)
    assert bm.get_block_table("b") == [3]
    check_invariants(bm)


def test_free_returns_every_block_and_is_idempotent():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", 9)
    assert bm.allocate_slots(a, 9)
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert bm.get_block_table("a") == []
    assert bm.ref_counts == [0, 0, 0, 0]
    bm.free(a)  # already freed
    bm.free(make_request("never-allocated", 3))
    assert bm.num_free_blocks == 4
    assert bm.usage == 0.0
    check_invariants(bm)


def test_freed_blocks_are_reused_after_the_never_used_ones():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", 8)
    assert bm.allocate_slots(a, 8)  # blocks 0, 1
    bm.free(a)  # back on the right, tail first: queue 2, 3, 1, 0
    assert list(bm.free_block_queue) == [2, 3, 1, 0]
    b = make_request("b", 16)
    assert bm.allocate_slots(b, 16)
    assert bm.get_block_table("b") == [2, 3, 1, 0]


def test_full_cache_reports_full_usage():
    bm = BlockManager(num_blocks=2, block_size=8)
    assert bm.allocate_slots(make_request("a", 16), 16)
    assert bm.usage == 1.0
    assert bm.num_free_blocks == 0
    assert not bm.allocate_slots(make_request("b", 1), 1)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4), (True, 4)])
def test_invalid_sizes_raise_value_error(num_blocks, block_size):
    with pytest.raises(ValueError, match="positive integer"):
        BlockManager(num_blocks, block_size)


def test_negative_token_count_raises_value_error():
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate_slots(make_request("a", 1), -1)


_ops = st.lists(
    st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(0, 13)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 4, 8]), ops=_ops)
def test_random_allocations_and_frees_keep_the_pool_consistent(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    reqs = [make_request(f"r{i}", 1) for i in range(6)]
    for op, idx, n in ops:
        req = reqs[idx]
        if op == "free":
            bm.free(req)
            req.num_computed_tokens = 0
            assert bm.get_block_table(req.request_id) == []
        else:
            before = list(bm.get_block_table(req.request_id))
            free_before = bm.num_free_blocks
            need = -(-(req.num_computed_tokens + n) // block_size)
            ok = bm.allocate_slots(req, n)
            table = bm.get_block_table(req.request_id)
            assert ok == (need - len(before) <= free_before)
            if ok:
                assert len(table) == max(need, len(before))
                assert table[: len(before)] == before
                req.num_computed_tokens += n
            else:  # all-or-nothing
                assert table == before
                assert bm.num_free_blocks == free_before
        check_invariants(bm)

from __future__ import annotations

from collections import Counter

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


# ---------------------------------------------------------------- prefix caching


def seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(), max_tokens=16)


def run(bm: BlockManager, req: Sequence, n: int | None = None) -> list[int]:
    """Admit `req` as the scheduler does (hits first), compute `n` tokens; its table."""
    hits = bm.get_computed_blocks(req)
    cached = len(hits) * bm.block_size
    n = req.num_tokens - cached if n is None else n
    assert bm.allocate_slots(req, n, hits)
    req.num_computed_tokens = cached + n
    return bm.get_block_table(req.request_id)


def check_cache(bm: BlockManager) -> None:
    free = list(bm.free_block_queue)
    assert len(free) == len(set(free))
    holders = Counter(b for table in bm.block_tables.values() for b in table)
    assert all(bm.ref_counts[b] == holders[b] for b in range(bm.num_total_blocks))
    assert set(free) == {b for b in range(bm.num_total_blocks) if holders[b] == 0}
    assert all(bm.block_hash[b] == h for h, b in bm.cached_blocks.items())
    assert sum(h is not None for h in bm.block_hash) == len(bm.cached_blocks)


def test_a_freed_prompt_is_found_again_and_only_the_rest_is_allocated():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq("a", list(range(10)))  # blocks [0..3] [4..7] full, [8, 9] partial
    table_a = list(run(bm, a))
    bm.free(a)
    b = seq("b", [*range(10), 50, 51, 52])
    hits = bm.get_computed_blocks(b)
    assert hits == table_a[:2]  # the two full blocks; never the partial one
    assert bm.allocate_slots(b, 5, hits)
    assert bm.get_block_table("b")[:2] == table_a[:2]
    assert len(bm.get_block_table("b")) == 4  # cdiv(8 + 5, 4)
    assert all(bm.ref_counts[x] == 1 for x in table_a[:2])
    check_cache(bm)


def test_at_least_the_last_token_is_left_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq("a", list(range(8)))
    run(bm, a)
    bm.free(a)
    # The same 8 tokens: both blocks are cached, but the last token must produce logits.
    assert len(bm.get_computed_blocks(seq("b", list(range(8))))) == 1
    assert len(bm.get_computed_blocks(seq("c", list(range(9))))) == 2
    assert bm.get_computed_blocks(seq("d", list(range(4)))) == []


def test_a_running_requests_blocks_are_shared_by_reference():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, b = seq("a", list(range(9))), seq("b", [*range(9), 7])
    table_a = run(bm, a)
    table_b = run(bm, b)
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    assert [bm.ref_counts[x] for x in table_a[:2]] == [2, 2]
    bm.free(a)
    assert [bm.ref_counts[x] for x in table_a[:2]] == [1, 1]
    assert table_a[0] not in bm.free_block_queue
    check_cache(bm)
    bm.free(b)
    assert bm.num_free_blocks == 8
    check_cache(bm)


def test_the_chain_not_the_block_alone_decides_a_hit():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    run(bm, a)
    bm.free(a)
    # Block 1 has the same tokens, after a different block 0: different K/V, no hit.
    assert bm.get_computed_blocks(seq("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_cached_free_blocks_are_evicted_least_recently_freed_first_and_only_when_needed():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 9])  # 2 full blocks + 1 partial
    run(bm, a)
    bm.free(a)  # all 3 cached-or-free blocks back; the never-used block 3 stays first
    assert len(bm.get_computed_blocks(seq("x", [1, 2, 3, 4, 5]))) == 2
    c = seq("c", [7, 7, 7])
    run(bm, c)  # needs 2 fresh blocks: block 3, then a's partial (uncached) tail block
    assert len(bm.get_computed_blocks(seq("x", [1, 2, 3, 4, 5]))) == 2
    d = seq("d", [8, 8])
    run(bm, d)  # one more: a's second block (freed before its first) is evicted
    assert len(bm.get_computed_blocks(seq("x", [1, 2, 3, 4, 5]))) == 1
    check_cache(bm)


def test_a_hit_is_taken_out_of_the_free_queue_and_all_or_nothing_holds():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    run(bm, a)
    bm.free(a)
    b = seq("b", [1, 2, 3, 4, 5, 6, 7, 8])
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    # 2 hits (both free) + cdiv(8, 2) - 2 = 2 fresh blocks > 3 free: refused, nothing taken.
    assert not bm.allocate_slots(b, 4, hits)
    assert bm.num_free_blocks == 3 and bm.get_block_table("b") == []
    assert bm.allocate_slots(b, 2, hits)  # 2 hits + 1 fresh
    assert bm.num_free_blocks == 0
    check_cache(bm)


def test_blocks_registered_for_a_step_that_never_ran_are_not_cached():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq("a", list(range(9)))
    assert bm.allocate_slots(a, 9)  # scheduled: blocks 0, 1 registered for this step
    assert len(bm.cached_blocks) == 2
    bm.free(a)  # preempted inside the same schedule(): num_computed_tokens is still 0
    assert bm.cached_blocks == {}
    assert bm.get_computed_blocks(seq("b", list(range(9)))) == []
    check_cache(bm)


def test_prefix_caching_off_finds_nothing_and_reset_forgets_everything():
    off = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(9)))
    run(off, a)
    off.free(a)
    assert off.get_computed_blocks(seq("b", list(range(9)))) == []
    assert off.cached_blocks == {}

    on = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq("a", list(range(9)))
    run(on, a)
    assert on.reset_prefix_cache() == 2
    on.free(a)
    assert on.get_computed_blocks(seq("b", list(range(9)))) == []
    check_cache(on)


def test_decode_tokens_fill_blocks_that_are_cached_too():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3])
    run(bm, a)
    for t in (4, 5, 6, 7, 8):  # sampled tokens, computed one per step
        a.append_output_token(t)
        assert bm.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    bm.free(a)
    turn2 = seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # the conversation so far, plus more
    assert len(bm.get_computed_blocks(turn2)) == 2


_cache_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "free"]),
        st.integers(0, 5),
        st.integers(0, 12),
        st.integers(0, 3),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]), ops=_cache_ops)
def test_random_prefix_cached_workloads_keep_the_pool_consistent(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    reqs: dict[int, Sequence] = {}
    for op, idx, n, variant in ops:
        req = reqs.get(idx)
        if op == "admit" and req is None:
            # Prompts from a few families, so they share prefixes of different lengths.
            tokens = [variant if i % (variant + 2) == 0 else i for i in range(n + 1)]
            req = reqs[idx] = seq(f"r{idx}-{len(ops)}", tokens)
            hits = bm.get_computed_blocks(req)
            assert len(hits) * block_size <= req.num_tokens - 1
            free_before = bm.num_free_blocks
            todo = req.num_tokens - len(hits) * block_size
            if bm.allocate_slots(req, todo, hits):
                req.num_computed_tokens = req.num_tokens
            else:
                assert bm.num_free_blocks == free_before
                assert bm.get_block_table(req.request_id) == []
                del reqs[idx]
        elif op == "grow" and req is not None:
            req.append_output_token(n)
            if bm.allocate_slots(req, 1):
                req.num_computed_tokens += 1
            else:
                req.output_token_ids.pop()
        elif op == "free" and req is not None:
            bm.free(req)
            del reqs[idx]
        check_cache(bm)
    for req in list(reqs.values()):
        bm.free(req)
    check_cache(bm)
    assert bm.num_free_blocks == num_blocks


# ---------------------------------------------------------------- cache salts (issue 27 item 4)


def salted(request_id: str, tokens: list[int], salt: str | None) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(cache_salt=salt), max_tokens=16)


def test_different_salts_share_no_block_and_equal_salts_share_as_before():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(13))  # three full blocks
    run(bm, salted("a", prompt, "tenant-a"))
    # Another salt, or none, finds nothing: not even the first block.
    assert bm.get_computed_blocks(salted("b", prompt, "tenant-b")) == []
    assert bm.get_computed_blocks(salted("c", prompt, None)) == []
    # The same salt hits every full block, as an unsalted prompt does without salts.
    assert len(bm.get_computed_blocks(salted("d", prompt, "tenant-a"))) == 3
    run(bm, salted("e", prompt, None))
    assert len(bm.get_computed_blocks(salted("f", prompt, None))) == 3
    check_cache(bm)


_salted_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "free"]),
        st.integers(0, 5),
        st.integers(0, 12),
        st.sampled_from([None, "a", "b", "ab"]),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]), ops=_salted_ops)
def test_a_block_is_only_ever_a_hit_for_the_salt_that_computed_it(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    reqs: dict[int, Sequence] = {}
    computed_by: dict[int, str | None] = {}  # block id -> salt of the request that filled it

    def record(req: Sequence, first: int) -> None:
        table = bm.get_block_table(req.request_id)
        for i in range(first, req.num_computed_tokens // block_size):
            computed_by[table[i]] = req.sampling_params.cache_salt

    for op, idx, n, salt in ops:
        req = reqs.get(idx)
        if op == "admit" and req is None:
            # Every prompt starts alike, so without salts they would all share blocks.
            req = salted(f"r{idx}-{len(ops)}", [i % 3 for i in range(n + 1)], salt)
            hits = bm.get_computed_blocks(req)
            assert all(computed_by[b] == salt for b in hits), "a hit across salts"
            if bm.allocate_slots(req, req.num_tokens - len(hits) * block_size, hits):
                reqs[idx] = req
                req.num_computed_tokens = req.num_tokens
                record(req, len(hits))
        elif op == "grow" and req is not None:
            req.append_output_token(n % 3)
            if bm.allocate_slots(req, 1):
                req.num_computed_tokens += 1
                record(req, (req.num_computed_tokens - 1) // block_size)
            else:
                req.output_token_ids.pop()
        elif op == "free" and req is not None:
            bm.free(req)
            del reqs[idx]
        check_cache(bm)

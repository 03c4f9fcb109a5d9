"""Block tables for hand-built paged KV caches in attention tests."""

from __future__ import annotations

import random


def shuffled_block_tables(seq_lens: list[int], block_size: int, seed: int) -> list[list[int]]:
    """One block table per request covering its seq_len, drawn from blocks 1.. in a shuffled
    order (block 0 stays unused, so a table read past its end shows up): the cache needs
    sum of the tables' lengths + 1 blocks."""
    counts = [-(-s // block_size) for s in seq_lens]
    ids = list(range(1, sum(counts) + 1))
    random.Random(seed).shuffle(ids)
    tables, start = [], 0
    for n in counts:
        tables.append(ids[start : start + n])
        start += n
    return tables

"""Paged KV cache bookkeeping: which physical blocks hold which request's tokens.

The KV cache is `num_blocks` fixed-size blocks of `block_size` token slots each. A request
owns a block table (logical block i -> physical block id) that grows on demand, one block
at a time, as the scheduler hands it new tokens. Nothing here touches tensors: the model
runner turns block tables into slot numbers.

Slot maths (block_size = 4; a request with num_computed_tokens = 6 gets 5 new tokens):

    token index      0  1  2  3 | 4  5  6  7 | 8  9 10 11
    state            c  c  c  c | c  c  n  n | n  n  n  .      c = in cache, n = new
    logical block         0     |     1      |     2
    block table     [     7     ,     2      ,     9     ]
                    held already: 2 blocks     needed: cdiv(6 + 5, 4) = 3 -> allocate 1

    slot(t) = block_table[t // block_size] * block_size + t % block_size
    e.g. token 9 -> block_table[2] * 4 + 1 = 9 * 4 + 1 = 37

Invariants (checked by the property tests):
    * every block is either in the free queue (ref count 0) or referenced (ref count > 0);
      len(free queue) + blocks in use == num_blocks, and the free queue has no duplicates;
    * without prefix sharing, a block's ref count is the number of tables holding it.
"""

from __future__ import annotations

from collections import deque

from conveyor.core.sequence import Sequence
from conveyor.validation import check_positive_int


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


class BlockManager:
    """Fixed-size KV blocks with ref counts, a free queue and per-request block tables.

    Ref counts leave room for prefix caching and n > 1 sharing prompt blocks: a block goes
    back to the free queue only when its last holder frees it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """Args:
        num_blocks: physical KV blocks in the cache.
        block_size: token slots per block.
        """
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        self.block_size = block_size
        self._num_blocks = num_blocks
        # Read-only outside this class (tests and metrics look at them).
        self.ref_counts: list[int] = [0] * num_blocks
        # Blocks are taken from the left and returned on the right, so recently freed blocks
        # are reused last (prefix caching will hit them before they are evicted).
        self.free_block_queue: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 (empty) to 1.0 (full)."""
        return 1.0 - len(self.free_block_queue) / self._num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Sequence, num_new_tokens: int) -> bool:
        """Make the request's block table cover its computed tokens plus `num_new_tokens`.

        Only the missing blocks are allocated. All-or-nothing: when the free queue is too
        short nothing is allocated and the table is left as it was.

        Args:
            request: the request; its `num_computed_tokens` says how many tokens are cached.
            num_new_tokens: tokens the next step will write into the cache.
        Returns:
            True if the table now covers `num_computed_tokens + num_new_tokens` tokens.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}.")
        table = self.block_tables.get(request.request_id)
        num_held = 0 if table is None else len(table)
        num_missing = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - num_held
        if num_missing <= 0:
            return True
        free_queue = self.free_block_queue
        if num_missing > len(free_queue):
            return False
        if table is None:
            table = self.block_tables[request.request_id] = []
        ref_counts = self.ref_counts
        for _ in range(num_missing):
            block_id = free_queue.popleft()
            ref_counts[block_id] += 1
            table.append(block_id)
        return True

    def free(self, request: Sequence) -> None:
        """Drop the request's hold on every block in its table.

        A block whose ref count reaches 0 goes back to the free queue. Idempotent: a request
        that holds no blocks (never allocated, or already freed) is a no-op.
        """
        table = self.block_tables.pop(request.request_id, None)
        if table is None:
            return
        ref_counts = self.ref_counts
        free_queue = self.free_block_queue
        # Tail first: the last blocks of a sequence are the least likely to be shared as a
        # prefix, so with prefix caching they should be the first to be reused.
        for block_id in reversed(table):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                free_queue.append(block_id)

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's block table (logical -> physical block id); empty if it holds none.

        The list is the live table: do not mutate it. It only grows by appends while the
        request keeps its blocks, so a copy is not needed to read one step's table.
        """
        table = self.block_tables.get(request_id)
        return [] if table is None else table

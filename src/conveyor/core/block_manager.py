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

Prefix caching (`enable_prefix_caching`): a FULL block is known by a hash chain,
hash_i = sha256(hash_{i-1} + its token ids), so equal hashes mean equal tokens at equal
positions after an equal prefix, hence equal K/V. hash_{-1} is the root, or for a request with a
`cache_salt` sha256(root + salt): the salt enters the first block's hash, so requests with
different salts share no block at all (and requests with the same salt share as before).
A block is registered under its hash when it is allocated for the step that fills it (the
model writes every layer's K/V for the whole batch before that layer attends, so a request
scheduled later in the same step may already read it).
A freed block keeps its hash and content and joins the free queue; a new request takes the
longest chain of registered blocks (`get_computed_blocks`), pulling free ones back out of the
queue. A fresh block is taken from the queue's head (least recently freed), and only then does
a cached block lose its hash (eviction):

    request A  [h0 h1 h2 | partial]     freed: queue ... h2 h1 h0   (tail first: h2 goes first)
    request B  same prompt + more   ->  hits h0 h1 h2 (ref 1 each), computes the rest only

Invariants (checked by the property tests):
    * every block is either in the free queue (ref count 0) or referenced (ref count > 0);
      len(free queue) + blocks in use == num_blocks, and the free queue has no duplicates;
    * a block's ref count is the number of tables holding it;
    * every registered hash names a block that carries that hash, and at most one block per
      hash is registered.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from conveyor.core.sequence import Sequence
from conveyor.validation import check_positive_int

_ROOT_HASH = b"conveyor-prefix-cache-v1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """sha256(parent hash + the block's token ids as int64): cryptographic, so no client can
    build a block that collides with another client's (Python's hash() can be collided)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def root_hash(cache_salt: str | None) -> bytes:
    """The parent of a request's first block: the root, or the root hashed with a separator
    and the salt (no block hashes the same: the separator's first 8 bytes, read as an int64
    token id, are above 2^56, far outside any vocabulary)."""
    if cache_salt is None:
        return _ROOT_HASH
    salt = cache_salt.encode("utf-8", "surrogatepass")  # any str: a lone surrogate too
    return hashlib.sha256(_ROOT_HASH + b"\x00cache_salt\x00" + salt).digest()


def block_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[bytes]:
    """`seq.block_hashes` extended to at least `num_blocks` full blocks of its known tokens.

    Computed once per block and kept on the sequence (tokens never change once known).
    """
    hashes = seq.block_hashes
    if len(hashes) < num_blocks:
        parent = hashes[-1] if hashes else root_hash(seq.sampling_params.cache_salt)
        for i in range(len(hashes), num_blocks):
            parent = hash_block(parent, seq.token_slice(i * block_size, (i + 1) * block_size))
            hashes.append(parent)
    return hashes


class BlockManager:
    """Fixed-size KV blocks with ref counts, an LRU free queue and per-request block tables.

    A block goes back to the free queue only when its last holder frees it. With prefix
    caching, requests with a common prefix hold the same blocks (ref count > 1).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        """Args:
        num_blocks: physical KV blocks in the cache.
        block_size: token slots per block.
        enable_prefix_caching: keep full blocks' K/V findable by hash after they are freed.
        """
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        # Read-only outside this class (tests and metrics look at them).
        self.ref_counts: list[int] = [0] * num_blocks
        # Free blocks in LRU order (keys; values unused): taken from the head, returned at the
        # tail, and a prefix-cache hit takes one out of the middle, all O(1).
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        # Prefix cache: hash -> the block registered under it, and each block's hash.
        self.cached_blocks: dict[bytes, int] = {}
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Per request: how many leading blocks of its table are registered.
        self._num_registered: dict[str, int] = {}
        # Lookups of admitted requests, in tokens (vLLM's prefix cache queries / hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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

    def get_computed_blocks(self, request: Sequence) -> list[int]:
        """The longest chain of registered blocks that starts the request's known tokens.

        Capped so that at least the last known token is left to compute (it produces the
        logits to sample from). Read-only: pass the result to `allocate_slots`. Empty when
        prefix caching is off or the request already holds blocks.
        """
        if not self.enable_prefix_caching or request.request_id in self.block_tables:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return []
        cached = self.cached_blocks
        hits: list[int] = []
        for h in block_hashes(request, self.block_size, max_blocks)[:max_blocks]:
            block_id = cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(
        self, request: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make the request's block table cover its computed tokens plus `num_new_tokens`.

        Only the missing blocks are allocated. All-or-nothing: when the free queue is too
        short nothing changes.

        Args:
            request: the request; `num_computed_tokens` says how many tokens are cached.
            num_new_tokens: tokens the next step will write into the cache.
            computed_blocks: a request holding no blocks yet: the prefix-cache hits from
                `get_computed_blocks`, which start its table; the caller then sets
                `num_computed_tokens` to `len(computed_blocks) * block_size` (this method
                counts them as computed already).
        Returns:
            True if the table now covers `num_computed_tokens + num_new_tokens` tokens.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}.")
        rid = request.request_id
        table = self.block_tables.get(rid)
        if table is not None and not computed_blocks:
            return self._grow(request, table, request.num_computed_tokens + num_new_tokens)
        hits = computed_blocks or []
        if hits and table is not None:
            raise ValueError(f"request {rid!r} already holds blocks; it cannot take cache hits.")
        num_held = len(table) if table is not None else len(hits)
        num_computed = len(hits) * self.block_size if hits else request.num_computed_tokens
        num_missing = cdiv(num_computed + num_new_tokens, self.block_size) - num_held
        free_queue = self.free_block_queue
        ref_counts = self.ref_counts
        # Hits sitting in the free queue leave it too.
        num_free_hits = sum(1 for b in hits if ref_counts[b] == 0)
        if max(num_missing, 0) + num_free_hits > len(free_queue):
            return False
        if table is None:
            if num_missing <= 0 and not hits:
                return True
            table = self.block_tables[rid] = []
        for block_id in hits:
            if ref_counts[block_id] == 0:
                del free_queue[block_id]
            ref_counts[block_id] += 1
            table.append(block_id)
        if hits:
            self._num_registered[rid] = len(hits)
        for _ in range(num_missing):
            block_id = self._take_free_block()
            ref_counts[block_id] += 1
            table.append(block_id)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, table, (num_computed + num_new_tokens))
        return True

    def _grow(self, request: Sequence, table: list[int], num_tokens: int) -> bool:
        """`allocate_slots` for a request that holds blocks and takes no hits (every running
        request, every step): extend `table` to cover `num_tokens` tokens, all-or-nothing.
        A decode step usually needs no new block at all."""
        num_missing = -(-num_tokens // self.block_size) - len(table)
        if num_missing > 0:
            if num_missing > len(self.free_block_queue):
                return False
            ref_counts = self.ref_counts
            for _ in range(num_missing):
                block_id = self._take_free_block()
                ref_counts[block_id] += 1
                table.append(block_id)
        if self.enable_prefix_caching:  # a block that this step fills: register it
            num_registered = self._num_registered.get(request.request_id, 0)
            if num_tokens // self.block_size > num_registered:
                self._register_full_blocks(request, table, num_tokens)
        return True

    def _take_free_block(self) -> int:
        """The least recently freed block, its cached content (if any) evicted."""
        block_id, _ = self.free_block_queue.popitem(last=False)
        self._unregister(block_id)
        return block_id

    def _unregister(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            del self.cached_blocks[h]

    def _register_full_blocks(self, request: Sequence, table: list[int], num_tokens: int) -> None:
        """Register the table's blocks that `num_tokens` tokens fill, under their hashes."""
        rid = request.request_id
        start = self._num_registered.get(rid, 0)
        full = num_tokens // self.block_size
        if full <= start:
            return
        hashes = block_hashes(request, self.block_size, full)
        cached, block_hash = self.cached_blocks, self.block_hash
        for i in range(start, full):
            h, block_id = hashes[i], table[i]
            # Another request computed this very content at the same time: keep the first.
            if h not in cached and block_hash[block_id] is None:
                cached[h] = block_id
                block_hash[block_id] = h
        self._num_registered[rid] = full

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (tokens asked for, tokens hit)."""
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def free(self, request: Sequence) -> None:
        """Drop the request's hold on every block in its table.

        A block whose ref count reaches 0 goes back to the free queue (keeping its cached
        content, if any, until the block is reused). Idempotent: a request that holds no
        blocks (never allocated, or already freed) is a no-op.
        """
        table = self.block_tables.pop(request.request_id, None)
        num_registered = self._num_registered.pop(request.request_id, 0)
        if table is None:
            return
        # Blocks registered for a step that has not run yet (the request is preempted or
        # aborted while being scheduled) hold no K/V: unregister them.
        for i in range(request.num_computed_tokens // self.block_size, num_registered):
            self._unregister(table[i])
        ref_counts = self.ref_counts
        free_queue = self.free_block_queue
        # Tail first: the last blocks of a sequence are the least likely to be shared as a
        # prefix, so they are the first to be reused.
        for block_id in reversed(table):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                free_queue[block_id] = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (e.g. after a step failed and its K/V is unknown).

        Blocks stay where they are (held or free); only their hashes go. Returns how many
        registrations were dropped.
        """
        n = len(self.cached_blocks)
        self.cached_blocks.clear()
        self.block_hash = [None] * self._num_blocks
        for rid in self._num_registered:
            self._num_registered[rid] = len(self.block_tables.get(rid, ()))
        return n

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's live block table (logical -> physical id; empty if none): read it,
        never mutate it (it only grows by appends, so one step's read needs no copy)."""
        table = self.block_tables.get(request_id)
        return [] if table is None else table

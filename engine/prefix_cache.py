"""`PrefixCache`: reuse of full KV blocks between requests by content hash.

A full block's hash is xxhash64 over its parent block's hash and its token
ids (`hash_block_tokens`), so a hash names the whole prefix up to and
including that block and equal hashes mean equal prefixes. The cache maps
hash -> block id for blocks whose KV is computed. Cached blocks with ref
count 0 sit in the `BlockPool` free queue and stay reusable until
`allocate` hands them out again: that is the LRU eviction (the free queue's
head is the least recently freed block).

Counters are in blocks: `num_queries` full blocks looked up, `num_hits`
found. With caching off, `match` finds nothing and counts nothing.

Only the engine loop thread calls this (via `engine.block_manager`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import xxhash

from engine.block_pool import BlockPool

_ROOT_PARENT = b"pdserve-prefix-root\x00"


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """xxhash64 of (parent block hash, this block's token ids)."""
    h = xxhash.xxh64()
    h.update(_ROOT_PARENT if parent_hash is None else struct.pack("<Q", parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.intdigest()


def extend_block_hashes(
    block_hashes: list[int], token_ids: Sequence[int], block_size: int
) -> None:
    """Append the hashes of full blocks of `token_ids` not yet in `block_hashes`.

    Token lists are append-only, so hashes already computed stay valid.
    """
    for i in range(len(block_hashes), len(token_ids) // block_size):
        parent = block_hashes[i - 1] if i else None
        block = token_ids[i * block_size : (i + 1) * block_size]
        block_hashes.append(hash_block_tokens(parent, block))


class PrefixCache:
    """Hash -> block id map over a `BlockPool`, with LRU eviction via its free queue."""

    __slots__ = ("enabled", "num_hits", "num_queries", "_block_of_hash", "_hash_of_block",
                 "_pool")

    def __init__(self, pool: BlockPool, *, enabled: bool = True) -> None:
        self._pool = pool
        self.enabled = enabled
        self._block_of_hash: dict[int, int] = {}
        self._hash_of_block: dict[int, int] = {}
        self.num_queries = 0
        self.num_hits = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_hash)

    def cached_block(self, block_hash: int) -> int | None:
        return self._block_of_hash.get(block_hash)

    def match(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `block_hashes` (not acquired)."""
        if not self.enabled:
            return []
        self.num_queries += len(block_hashes)
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._block_of_hash.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        self.num_hits += len(block_ids)
        return block_ids

    def num_cached(self, block_hashes: Sequence[int]) -> int:
        """Length in blocks of the longest cached prefix of `block_hashes`,
        like `match` but not counted as a query."""
        if not self.enabled:
            return 0
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self._block_of_hash:
                break
            n += 1
        return n

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on matched blocks, reviving those in the free queue."""
        self._pool.touch(block_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks from the pool; cached ones among them are evicted here."""
        block_ids = self._pool.allocate(num_blocks)
        for block_id in block_ids:
            block_hash = self._hash_of_block.pop(block_id, None)
            if block_hash is not None:
                del self._block_of_hash[block_hash]
        return block_ids

    def insert(self, block_hash: int, block_id: int) -> None:
        """Record that `block_id` holds the computed KV of the prefix `block_hash`.

        When another block already holds the same prefix (two requests
        computed it concurrently) the first one stays the cached copy.
        """
        if not self.enabled or block_hash in self._block_of_hash:
            return
        if block_id in self._hash_of_block:
            return  # already caches this (immutable) prefix
        self._block_of_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop a request's references, last block first so its tail is evicted first."""
        self._pool.free(reversed(block_ids))

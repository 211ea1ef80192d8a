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
A `CacheListener` (set with `set_listener`) hears every hash that enters
(`stored`) or leaves (`evicted`) the map, in order, so a pod can tell the
routers what it holds (pod/cache_events.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from engine.block_pool import BlockPool
from proto.block_hash import extend_block_hashes, hash_block_tokens

__all__ = ["CacheListener", "PrefixCache", "extend_block_hashes", "hash_block_tokens"]


class CacheListener(Protocol):
    """Told of every change to the set of cached prefixes (pod/cache_events.py
    publishes them to the routers). Called on the engine loop thread, inside
    `insert` / `allocate`: it must only record, never block."""

    def stored(self, block_hash: int) -> None: ...

    def evicted(self, block_hash: int) -> None: ...


class PrefixCache:
    """Hash -> block id map over a `BlockPool`, with LRU eviction via its free queue."""

    __slots__ = ("enabled", "num_hits", "num_queries", "_block_of_hash", "_hash_of_block",
                 "_listener", "_pool")

    def __init__(self, pool: BlockPool, *, enabled: bool = True) -> None:
        self._pool = pool
        self.enabled = enabled
        self._block_of_hash: dict[int, int] = {}
        self._hash_of_block: dict[int, int] = {}
        self.num_queries = 0
        self.num_hits = 0
        self._listener: CacheListener | None = None

    def set_listener(self, listener: CacheListener | None) -> None:
        """Tell `listener` of every stored and evicted hash from now on (engine
        loop thread; `cached_hashes` gives the state to start from)."""
        self._listener = listener

    def cached_hashes(self) -> list[int]:
        """Every hash cached now (the snapshot a new subscriber starts from)."""
        return list(self._block_of_hash)

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
                if self._listener is not None:
                    self._listener.evicted(block_hash)
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
        if self._listener is not None:
            self._listener.stored(block_hash)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop a request's references, last block first so its tail is evicted first."""
        self._pool.free(reversed(block_ids))

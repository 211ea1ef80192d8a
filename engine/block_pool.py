"""`BlockPool`: the KV cache's block ids, their ref counts and the free queue.

Block ids index the second dimension of every layer's KV tensor
(`engine.kv_cache`). A block is *in use* while its ref count is > 0 (one
count per request whose block table holds it; a prefix-cache hit shares a
block between requests). A block whose count drops to 0 goes to the tail of
the free queue. `allocate` takes from the head, so the free queue is also
the LRU eviction order of the prefix cache: a block freed with a cached hash
stays reusable (`touch`) until `allocate` hands it out again.

Only the engine loop thread calls this (via `engine.block_manager`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    """Fixed set of `num_blocks` block ids; nothing grows after start."""

    __slots__ = ("_free", "_ref_counts")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._ref_counts = [0] * num_blocks
        # Insertion order = allocation order: head is the least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_total_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be allocated) first."""
        return list(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` ids from the head of the free queue, ref count 1 each.

        The caller checks `num_free_blocks` first; asking for more is a bug.
        """
        if num_blocks > len(self._free):
            raise RuntimeError(
                f"allocate({num_blocks}) with only {len(self._free)} free blocks"
            )
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix-cache hit), reviving free ones."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order.

        Blocks reaching 0 join the free queue's tail in that order, so the
        caller decides which are evicted first (a request frees its blocks
        last-first: a shared prefix outlives its private tail).
        """
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed with ref count {count}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

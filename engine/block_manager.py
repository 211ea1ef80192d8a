"""`BlockManager`: which KV blocks each request holds, with prefix-cache reuse.

Sits between the scheduler and the `BlockPool` / `PrefixCache`: it grows a
request's block table as its tokens are scheduled, maps prefix-cache hits
into it on first schedule, registers blocks in the prefix cache once their
KV is computed, and gives everything back when the request finishes, is
aborted or is preempted.

Contract on `request.block_ids` (tensor-parallel step descriptions rely on
it, engine/parallel/step_wire.py): a table is append-only while the same
list object is installed: blocks are only ever added at its end
(`allocate`, `allocate_slots`). It is replaced, never edited in place, by
installing a new list object: `detach` (finish, abort, preemption) leaves a
new empty list, `match_prefix` installs the list of the matched prefix.
So "same object, longer" means "these ids were appended", and a different
object means "start over from this table".

Only the engine loop thread calls this (scheduler and `LLMEngine`).
"""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.prefix_cache import PrefixCache, extend_block_hashes
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Per-request block tables over one pool of `num_blocks` blocks."""

    __slots__ = ("block_size", "pool", "prefix_cache")

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = PrefixCache(self.pool, enabled=enable_prefix_caching)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total_blocks

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so the table covers `num_computed_tokens + num_new_tokens`."""
        num_slots = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(num_slots, self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(request, num_new_tokens) <= self.pool.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow `request.block_ids` to hold `num_new_tokens` more tokens (checked first)."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed:
            request.block_ids.extend(self.prefix_cache.allocate(needed))

    def allocate_slots(self, request: Request, num_tokens: int) -> None:
        """Grow the table to `num_tokens` slots in all (a remote reservation)."""
        needed = cdiv(num_tokens, self.block_size) - len(request.block_ids)
        if needed > 0:
            request.block_ids.extend(self.prefix_cache.allocate(needed))

    def match_prefix(self, request: Request) -> int:
        """Map the longest cached prefix into a request that holds no blocks yet.

        At least one token is left to compute, because the last position's
        logits are needed to sample. Returns the number of cached tokens;
        `num_computed_tokens` is advanced by it.
        """
        assert not request.block_ids and request.num_computed_tokens == 0
        if not _reuses_cache(request, self.prefix_cache):
            return 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = self.prefix_cache.match(request.block_hashes[:max_blocks])
        self.prefix_cache.acquire(block_ids)
        request.block_ids = block_ids
        request.num_cached_blocks = len(block_ids)
        request.num_computed_tokens = len(block_ids) * self.block_size
        return request.num_computed_tokens

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Tokens `match_prefix` would map into `request` now (same cap), without
        taking references or counting a query: a look before deciding."""
        if not _reuses_cache(request, self.prefix_cache):
            return 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.prefix_cache.num_cached(request.block_hashes[:max_blocks]) * self.block_size

    def cache_computed_blocks(self, request: Request, num_computed: int | None = None) -> None:
        """Insert the request's newly completed full blocks into the prefix cache.
        `num_computed`: tokens whose KV is in the cache (default
        `num_computed_tokens`; with async scheduling that counts steps still in
        flight, so the engine passes what the completed step computed)."""
        if not self.prefix_cache.enabled:
            return
        if num_computed is None:
            num_computed = request.num_computed_tokens
        num_full = num_computed // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        for i in range(request.num_cached_blocks, num_full):
            self.prefix_cache.insert(request.block_hashes[i], request.block_ids[i])
        request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Give back every block of the request; cached ones stay reusable until evicted."""
        self.release(self.detach(request))

    def detach(self, request: Request) -> list[int]:
        """Take the block table away from the request (it holds nothing after)
        without giving the blocks back yet: the caller releases them once no
        step in flight writes them."""
        block_ids = request.block_ids
        request.block_ids = []
        request.num_cached_blocks = 0
        request.num_computed_tokens = 0
        return block_ids

    def release(self, block_ids: list[int]) -> None:
        """Return detached blocks to the pool (last-first, see `BlockPool`)."""
        self.prefix_cache.release(block_ids)


def _reuses_cache(request: Request, prefix_cache: PrefixCache) -> bool:
    """Whether `request` may start from cached blocks: not when it asks for
    prompt logprobs, which need every prompt position's logits (a cached
    position is never computed; engine.prompt_logprobs)."""
    return prefix_cache.enabled and request.sampling_params.prompt_logprobs is None

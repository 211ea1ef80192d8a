from engine.block_pool import BlockPool
from engine.prefix_cache import PrefixCache, extend_block_hashes, hash_block_tokens


def test_hash_is_chained_over_parent_and_tokens():
    h0 = hash_block_tokens(None, [1, 2])
    assert h0 == hash_block_tokens(None, [1, 2])
    assert h0 != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(h0, [3, 4]) != hash_block_tokens(None, [3, 4])
    hashes: list[int] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5], block_size=2)
    assert hashes == [h0, hash_block_tokens(h0, [3, 4])]  # partial block not hashed
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6], block_size=2)
    assert len(hashes) == 3 and hashes[2] == hash_block_tokens(hashes[1], [5, 6])


def _cache(num_blocks=4, enabled=True):
    pool = BlockPool(num_blocks)
    return pool, PrefixCache(pool, enabled=enabled)


def test_longest_prefix_match_and_counters():
    pool, cache = _cache()
    ids = cache.allocate(2)
    cache.insert(11, ids[0])
    cache.insert(22, ids[1])
    assert cache.match([11, 22, 33]) == [0, 1]
    assert cache.match([11, 99, 22]) == [0]
    assert cache.match([22]) == [1]  # hash names the whole prefix; lookup is by hash
    assert (cache.num_queries, cache.num_hits) == (7, 4)


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    pool, cache = _cache(num_blocks=4)
    a = cache.allocate(2)  # [0, 1]
    cache.insert(100, a[0])
    cache.insert(101, a[1])
    cache.release(a)  # last block first in the free queue tail
    assert pool.free_block_ids() == [2, 3, 1, 0]
    hit = cache.match([100, 101])
    assert hit == [0, 1]
    cache.acquire(hit)
    assert pool.ref_count(0) == 1 and pool.free_block_ids() == [2, 3]
    cache.release(hit)
    # Allocating 3 takes 2, 3 and then evicts block 1 (hash 101), the LRU cached one.
    assert cache.allocate(3) == [2, 3, 1]
    assert cache.cached_block(101) is None and cache.cached_block(100) == 0
    assert cache.match([100, 101]) == [0]
    assert cache.num_cached_blocks == 1


def test_duplicate_prefix_keeps_first_block_and_disabled_cache_is_inert():
    pool, cache = _cache()
    a, b = cache.allocate(2)
    cache.insert(7, a)
    cache.insert(7, b)
    assert cache.cached_block(7) == a and cache.num_cached_blocks == 1
    pool2, off = _cache(enabled=False)
    (c,) = off.allocate(1)
    off.insert(7, c)
    assert off.match([7]) == [] and (off.num_queries, off.num_hits) == (0, 0)


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def stored(self, block_hash: int) -> None:
        self.events.append(("stored", block_hash))

    def evicted(self, block_hash: int) -> None:
        self.events.append(("evicted", block_hash))


def test_listener_hears_stores_and_evictions_in_order():
    pool, cache = _cache(num_blocks=2)
    recorder = _Recorder()
    cache.set_listener(recorder)
    a, b = cache.allocate(2)
    cache.insert(100, a)
    cache.insert(100, b)  # same prefix twice: the first copy stays, no event
    cache.insert(101, b)
    cache.release([a, b])  # b first in the free queue (last-first)
    assert cache.cached_hashes() == [100, 101]
    cache.allocate(1)  # evicts b's hash 101
    assert recorder.events == [("stored", 100), ("stored", 101), ("evicted", 101)]
    assert cache.cached_hashes() == [100]

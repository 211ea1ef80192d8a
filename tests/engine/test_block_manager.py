from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def _req(rid, tokens):
    return Request(rid, tokens, SamplingParams())


def test_allocate_grows_table_by_whole_blocks():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    r = _req("a", range(10))
    assert bm.num_blocks_needed(r, 10) == 3
    bm.allocate(r, 10)
    assert r.block_ids == [0, 1, 2]
    r.num_computed_tokens = 10
    assert bm.num_blocks_needed(r, 2) == 0 and bm.num_blocks_needed(r, 3) == 1
    bm.free(r)
    assert r.block_ids == [] and bm.num_free_blocks == 8


def test_prefix_match_after_compute_leaves_last_token_to_compute():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    first = _req("a", range(8))
    bm.allocate(first, 8)
    first.num_computed_tokens = 8
    bm.cache_computed_blocks(first)
    assert first.num_cached_blocks == 2
    # Same 8 tokens: only one block may be reused (the last token must be computed).
    same = _req("b", range(8))
    assert bm.match_prefix(same) == 4 and same.block_ids == [0]
    longer = _req("c", [*range(8), 99])
    assert bm.match_prefix(longer) == 8 and longer.block_ids == [0, 1]
    assert bm.pool.ref_count(0) == 3 and bm.pool.ref_count(1) == 2
    for r in (first, same, longer):
        bm.free(r)
    assert bm.num_free_blocks == 8
    assert (bm.prefix_cache.num_queries, bm.prefix_cache.num_hits) == (3, 3)


def test_disabled_cache_matches_nothing():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    first = _req("a", range(8))
    bm.allocate(first, 8)
    first.num_computed_tokens = 8
    bm.cache_computed_blocks(first)
    assert bm.match_prefix(_req("b", range(9))) == 0

import pytest

from engine.block_pool import BlockPool


def test_allocate_takes_from_head_in_order():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.num_free_blocks == 2
    assert pool.ref_count(0) == 1 and pool.ref_count(2) == 0
    assert pool.free_block_ids() == [2, 3]


def test_free_appends_in_given_order_and_reuse_is_lru():
    pool = BlockPool(4)
    a = pool.allocate(3)
    pool.free(reversed(a))
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert pool.allocate(2) == [3, 2]


def test_touch_shares_and_revives_free_blocks():
    pool = BlockPool(3)
    pool.allocate(2)
    pool.touch([1])
    assert pool.ref_count(1) == 2
    pool.free([1])
    assert pool.ref_count(1) == 1 and pool.num_free_blocks == 1
    pool.free([0, 1])
    assert pool.free_block_ids() == [2, 0, 1]
    pool.touch([0])
    assert pool.free_block_ids() == [2, 1] and pool.ref_count(0) == 1


def test_overallocation_and_double_free_are_refused():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="only 2 free"):
        pool.allocate(3)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(RuntimeError, match="ref count 0"):
        pool.free(ids)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)

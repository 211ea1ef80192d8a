"""`pdserve bench index-memory` measures what the real PrefixIndex holds: the
count it checks is the index's own, and the bytes scale with the blocks."""

from __future__ import annotations

from benchmarks import index_memory


def test_the_index_holds_every_block_and_its_memory_grows_with_them():
    small = index_memory.measure(4, 200, seed=1)
    large = index_memory.measure(4, 2000, seed=1)
    # a hash in a dict costs tens of bytes, never nothing and never kilobytes
    assert 16 < small["bytes_per_block"] < 1000
    assert large["bytes"] > 5 * small["bytes"]
    assert small["bytes_per_pod"] * 4 == small["bytes"]

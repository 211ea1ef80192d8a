import random

import pytest

from kv_transfer.errors import BufferPoolExhausted
from kv_transfer.landing import LandingBufferPool


def test_accounting_is_exact():
    pool = LandingBufferPool(1024, pin_memory=False)
    a = pool.allocate(600)  # reserves 640 (64-byte alignment)
    b = pool.allocate(384)
    assert (a.offset, a.reserved, a.data.numel()) == (0, 640, 600)
    assert (b.offset, b.reserved) == (640, 384)
    assert pool.bytes_in_use == 1024 and pool.buffers_in_use == 2
    with pytest.raises(BufferPoolExhausted, match="0 of 1024 bytes free"):
        pool.allocate(1)
    pool.free(a)
    assert pool.bytes_in_use == 384 and pool.free_extents() == [(0, 640)]
    c = pool.allocate(64)
    pool.free(b)
    assert pool.free_extents() == [(64, 960)]
    pool.free(c)
    assert pool.bytes_in_use == 0 and pool.buffers_in_use == 0
    assert pool.free_extents() == [(0, 1024)]
    with pytest.raises(KeyError):
        pool.free(c)


def test_buffers_do_not_overlap_and_coalesce_back():
    pool = LandingBufferPool(64 * 100, pin_memory=False)
    rng = random.Random(5)
    live = []
    for _ in range(300):
        if live and rng.random() < 0.5:
            pool.free(live.pop(rng.randrange(len(live))))
            continue
        try:
            live.append(pool.allocate(rng.randint(1, 64 * 12)))
        except BufferPoolExhausted:
            continue
        spans = sorted((buf.offset, buf.offset + buf.reserved) for buf in live)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    for buf in live:
        pool.free(buf)
    assert pool.free_extents() == [(0, 6400)] and pool.bytes_in_use == 0


def test_fragmentation_is_reported():
    pool = LandingBufferPool(256, pin_memory=False)
    bufs = [pool.allocate(64) for _ in range(4)]
    pool.free(bufs[0])
    pool.free(bufs[2])
    with pytest.raises(BufferPoolExhausted, match="largest extent 64"):
        pool.allocate(128)


def test_validation():
    with pytest.raises(ValueError, match="capacity_bytes"):
        LandingBufferPool(0)
    with pytest.raises(ValueError, match="nbytes"):
        LandingBufferPool(128).allocate(0)

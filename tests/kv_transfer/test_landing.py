import pytest

from kv_transfer.errors import BufferPoolExhausted
from kv_transfer.landing import LandingBufferPool


def test_accounting_is_exact():
    pool = LandingBufferPool(1000, pin_memory=False)
    a = pool.allocate(600)
    b = pool.allocate(400)
    assert a.data.numel() == 600 and pool.bytes_in_use == 1000 and pool.buffers_in_use == 2
    with pytest.raises(BufferPoolExhausted, match="0 of 1000 bytes free, 1 requested"):
        pool.allocate(1)
    pool.free(a)
    assert pool.bytes_in_use == 400
    c = pool.allocate(600)
    pool.free(b)
    pool.free(c)
    assert pool.bytes_in_use == 0 and pool.buffers_in_use == 0
    with pytest.raises(KeyError):
        pool.free(c)


def test_validation():
    with pytest.raises(ValueError, match="capacity_bytes"):
        LandingBufferPool(0)
    with pytest.raises(ValueError, match="nbytes"):
        LandingBufferPool(10).allocate(0)

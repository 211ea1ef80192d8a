from types import SimpleNamespace

import pytest

from kv_transfer.base import KVLayout
from kv_transfer.errors import Reason, TransferRefused
from kv_transfer.row_state import RowState
from kv_transfer.writes import LandingWrites

LAYOUT = KVLayout(2, 4, 1, 2, "float32")  # row 8 bytes, 8 rows (64 bytes) per layer
OWNER = SimpleNamespace(request_id="r")  # stands in for the Incoming a claim points back to


def make_writes() -> LandingWrites:
    return LandingWrites(LAYOUT, memoryview(bytearray(LAYOUT.total_bytes)))


def states(writes: LandingWrites) -> list[RowState]:
    return [RowState(b) for b in writes.rows]


def test_claim_marks_rows_and_views_their_bytes():
    writes = make_writes()
    claim = writes.claim(OWNER, 0, 1, 16, 24)  # layer 1, rows 2..4
    assert (claim.request_id, claim.layer, claim.num_rows, claim.first, claim.epoch) == (
        "r", 1, 3, 10, 0)  # fmt: skip
    assert claim.transfer is OWNER
    claim.view[:] = b"\xab" * 24
    assert bytes(writes.data[64 + 16 : 64 + 40]) == b"\xab" * 24
    assert states(writes)[10:13] == [RowState.CLAIMED] * 3
    assert states(writes).count(RowState.FREE) == 13
    assert writes.writers == 1 and list(writes.inflight.values()) == [claim]


def test_claims_that_do_not_fit_or_repeat_are_refused():
    writes = make_writes()
    for layer, offset, length in [(2, 0, 8), (0, 4, 8), (0, 0, 12), (0, 0, 0), (0, 56, 16)]:
        with pytest.raises(TransferRefused) as info:
            writes.claim(OWNER, 0, layer, offset, length)
        assert info.value.code is Reason.BAD_FRAME
    writes.claim(OWNER, 0, 0, 0, 16)
    with pytest.raises(TransferRefused) as info:
        writes.claim(OWNER, 0, 0, 8, 16)  # overlaps row 1
    assert info.value.code is Reason.DUPLICATE_DATA
    assert writes.writers == 1


def test_commit_counts_landed_rows_only():
    writes = make_writes()
    ok = writes.claim(OWNER, 0, 0, 0, 32)
    bad = writes.claim(OWNER, 0, 0, 32, 32)
    assert writes.commit(ok, 0, landed=True)
    assert writes.commit(bad, 0, landed=False)
    assert writes.layer_rows == [4, 0] and writes.writers == 0 and not writes.inflight
    assert states(writes)[:8] == [RowState.CLAIMED] * 8  # a failed write stays claimed


def test_reset_leaves_a_writer_inside_draining_until_its_commit():
    writes = make_writes()
    done = writes.claim(OWNER, 0, 0, 0, 16)
    writes.commit(done, 0, landed=True)
    inside = writes.claim(OWNER, 0, 1, 0, 16)  # still being written
    writes.reset()  # the attempt was dropped (its epoch is now 1)
    assert states(writes)[:2] == [RowState.FREE] * 2
    assert states(writes)[8:10] == [RowState.DRAINING] * 2
    assert writes.layer_rows == [0, 0]
    assert writes.claim(OWNER, 1, 1, 8, 16) is None  # overlaps a draining row: wait
    assert not writes.commit(inside, 1, landed=True)  # stale: nothing counts
    assert writes.layer_rows == [0, 0] and states(writes) == [RowState.FREE] * 16
    again = writes.claim(OWNER, 1, 1, 8, 16)
    assert again is not None and again.epoch == 1

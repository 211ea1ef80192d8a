from kv_transfer.row_state import RowState


def test_row_bytes_keep_their_values():
    # the row bytearray stores these bytes: FREE must be 0 (a fresh bytearray)
    assert [int(s) for s in RowState] == [0, 1, 2]
    assert [s.name for s in RowState] == ["FREE", "CLAIMED", "DRAINING"]
    assert bytearray(3) == RowState.FREE.fill(3)


def test_fill():
    assert RowState.CLAIMED.fill(3) == b"\x01\x01\x01"
    assert RowState.DRAINING.fill(2) == b"\x02\x02"
    assert RowState.FREE.fill(0) == b""
    assert bytearray(RowState.CLAIMED.fill(4)).find(RowState.CLAIMED) == 0

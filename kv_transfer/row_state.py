"""`RowState`: what one row of a transfer's landing buffer is in the current attempt.

A row is one token's K or V of one layer (`KVLayout.row_bytes`); DATA frames
cover whole rows. `LandingWrites.rows` (writes.py) keeps one byte per row, a
`bytearray` so that a claim checks a range of rows with one `find`/`count`
call instead of a Python loop. Those bytes are `RowState` values:

    FREE ──claim──► CLAIMED ──attempt dropped, no writer inside──► FREE
                      │
                      └──attempt dropped, its writer still inside──► DRAINING
    DRAINING ──that writer's commit──► FREE

A claim over a CLAIMED row is a duplicate (refused); a claim over a DRAINING
row waits for the dropped writer's commit, so its stale bytes never land over
the new attempt's.
"""

from __future__ import annotations

import enum


class RowState(enum.IntEnum):
    FREE = 0  # must be 0: a fresh bytearray is all FREE
    CLAIMED = 1  # claimed by a writer of the current attempt (being written, or landed)
    DRAINING = 2  # a dropped attempt's writer is still inside: no claim until it commits

    def fill(self, num_rows: int) -> bytes:
        """`num_rows` rows in this state, to assign to a slice of the row bytes."""
        return bytes((self,)) * num_rows

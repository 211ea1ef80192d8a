"""Writes into one transfer's landing buffer: `LandingWrites` and `WriteClaim`.

Every DATA frame first claims its rows (`LandingWrites.claim`: refused if they
do not fit the layout or were already claimed in this attempt, so no two
writers ever touch the same bytes; not granted yet while a dropped attempt's
writer is still inside them), then the transport writes the payload straight
into the claim's `view` and commits it (`LandingWrites.commit`). A layer is
complete once all its rows committed. `writers` counts claims not yet
committed: the table returns the buffer to the pool only when it is 0.

Row states are `RowState` values (row_state.py). Not thread-safe: the receive
table calls it under its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kv_transfer.base import KVLayout
from kv_transfer.errors import Reason, TransferRefused
from kv_transfer.row_state import RowState


class _Transfer(Protocol):
    request_id: str


# The transfer a claim was granted in (kv_transfer.incoming.Incoming): only its
# request id is read here; the claim hands it back to the receive table.
T = TypeVar("T", bound=_Transfer)

# plain int and bytes: the per-frame claim stays free of enum lookups
_CLAIMED = RowState.CLAIMED.value
_DRAINING = RowState.DRAINING.value
_CLAIMED_ROW = RowState.CLAIMED.fill(1)


@dataclass(frozen=True, slots=True)
class WriteClaim(Generic[T]):
    """Permission to write `view` (the landing bytes of one DATA frame). The
    transport writes the payload into `view`, then calls `ReceiveTable.commit`."""

    request_id: str
    layer: int
    num_rows: int
    view: memoryview
    transfer: T  # the transfer it was granted in
    first: int = 0  # first row index (layer * rows_per_layer + row)
    epoch: int = 0  # the attempt it was granted to (Attempts.epoch)


class LandingWrites:
    """Row bookkeeping of one transfer's landing buffer (`data`)."""

    __slots__ = ("layout", "data", "rows", "layer_rows", "writers", "inflight")

    def __init__(self, layout: KVLayout, data: memoryview) -> None:
        self.layout = layout
        self.data = data  # the landing buffer's bytes, in the transfer layout
        self.rows = bytearray(layout.num_layers * layout.rows_per_layer)  # RowState per row
        self.layer_rows = [0] * layout.num_layers  # committed rows per layer
        self.writers = 0  # claims granted and not yet committed
        self.inflight: dict[int, WriteClaim] = {}  # id(claim) -> claim being written

    def claim(self, transfer: T, epoch: int, layer: int, offset: int,
              length: int) -> WriteClaim[T] | None:  # fmt: skip
        """Claim the rows of DATA (`layer`, `offset`, `length`) for attempt `epoch`.
        None while a dropped attempt's writer is still in them (the caller waits
        for a commit and asks again); raises TransferRefused (bad_frame: does not
        fit the layout; duplicate_data: already claimed in this attempt)."""
        lay = self.layout
        row = lay.row_bytes
        if (
            layer >= lay.num_layers or length <= 0 or offset % row or length % row
            or offset + length > lay.bytes_per_layer
        ):  # fmt: skip
            raise TransferRefused(
                Reason.BAD_FRAME,
                f"DATA layer {layer} offset {offset} length {length} does not fit {lay}",
            )
        first = layer * lay.rows_per_layer + offset // row
        num_rows = length // row
        if self.rows.find(_DRAINING, first, first + num_rows) >= 0:
            return None
        if self.rows.count(_CLAIMED, first, first + num_rows) > 0:
            raise TransferRefused(Reason.DUPLICATE_DATA, f"layer {layer} offset {offset}")
        self.rows[first : first + num_rows] = _CLAIMED_ROW * num_rows
        self.writers += 1
        start = layer * lay.bytes_per_layer + offset
        claim = WriteClaim(transfer.request_id, layer, num_rows, self.data[start : start + length],
                           transfer, first, epoch)  # fmt: skip
        self.inflight[id(claim)] = claim
        return claim

    def commit(self, claim: WriteClaim, epoch: int, landed: bool) -> bool:
        """`claim`'s writer left the buffer; its rows count for their layer if
        `landed`. False for a claim of a dropped attempt (`epoch` is the current
        one): its DRAINING rows become FREE and nothing counts."""
        self.writers -= 1
        del self.inflight[id(claim)]
        if claim.epoch != epoch:
            self.rows[claim.first : claim.first + claim.num_rows] = RowState.FREE.fill(
                claim.num_rows
            )
            return False
        if landed:
            self.layer_rows[claim.layer] += claim.num_rows
        return True

    def reset(self) -> None:
        """The current attempt was dropped: every row is FREE again except those a
        writer is still inside (DRAINING until its commit); no layer has rows."""
        self.rows = bytearray(len(self.rows))
        for c in self.inflight.values():
            self.rows[c.first : c.first + c.num_rows] = RowState.DRAINING.fill(c.num_rows)
        self.layer_rows = [0] * self.layout.num_layers

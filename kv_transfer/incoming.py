"""`Incoming`: one transfer on the receiving side, and the steps of its state machine.

It owns the transfer's landing buffer, its writes (`LandingWrites`,
writes.py), its sending attempts (`Attempts`, attempts.py) and its
`TransferState` (base.py, where the allowed transitions are checked). Only
`ReceiveTable` (receive_table.py) and `Transfers` (transfers.py) create and
drive it; every method here is called with the table's lock held, and none
calls out (listener or peers): the table does that after releasing the lock.
See receive_table.py for the state machine and the locking rules.
"""

from __future__ import annotations

import threading
import time

import torch

from kv_transfer.attempts import Attempts, Peer
from kv_transfer.base import KVLayout, TransferState
from kv_transfer.device import byte_view
from kv_transfer.landing import LandingBuffer
from kv_transfer.tombstones import Tombstone
from kv_transfer.writes import LandingWrites

_RECEIVING = (TransferState.STARTED, TransferState.ENDING)


class Incoming:
    """One transfer's state; guarded by the table's lock (`deliver_lock` aside)."""

    __slots__ = (
        "request_id", "expected", "layout", "deadline", "reservation_deadline",
        "transfer_timeout_s", "buffer", "writes", "attempts", "state", "num_senders",
        "reason", "next_layer", "delivered_any", "released", "end_peers",
        "first_token_id", "end_total", "finished_at", "deliver_lock",
    )  # fmt: skip

    def __init__(self, request_id: str, layout: KVLayout, deadline: float,
                 buffer: LandingBuffer,
                 transfer_timeout_s: float | None = None) -> None:  # fmt: skip
        self.request_id = request_id
        self.expected = layout  # what `expect` got
        # the current attempt's form of it: `expected`, or its head-major form when
        # a TP > 1 prefill pod's ranks fill a whole-model layout (KVLayout.accepts)
        self.layout = layout
        # Per phase (see `start_attempt`): waiting for a sender is bounded by the
        # reservation's deadline; a running attempt by its BEGIN + transfer_timeout_s.
        self.reservation_deadline = deadline
        self.transfer_timeout_s = transfer_timeout_s
        self.deadline = deadline  # the current phase's
        self.buffer: LandingBuffer | None = buffer  # None once back in the pool
        self.writes = LandingWrites(layout, byte_view(buffer.data))
        self.attempts = Attempts()
        self.state = TransferState.EXPECTED
        self.num_senders = 1  # senders of the current attempt (one per prefill rank)
        self.reason = ""  # why it failed ("" unless FAILED)
        self.next_layer = 0  # next layer to deliver
        self.delivered_any = False
        self.released = False  # the consumer said it is done with the views
        # the streams that carried END, one per sender: each gets the verdict
        self.end_peers: list[Peer] = []
        self.first_token_id = 0
        self.end_total = 0
        self.finished_at = 0.0
        # serialises listener calls for this transfer (see receive_table.py)
        self.deliver_lock = threading.RLock()

    def layer_view(self, layer: int) -> torch.Tensor:
        assert self.buffer is not None
        bpl = self.layout.bytes_per_layer
        return self.layout.layer_view(self.buffer.data[layer * bpl : (layer + 1) * bpl])

    def tombstone(self) -> Tombstone:
        """How it ended (for frames still in flight once it is gone)."""
        return Tombstone.of(self.reason, self.attempts.current)

    # ---------------------------------------------------------------- attempts

    def superseded_by(self, attempt: bytes) -> bool:
        """A BEGIN of `attempt` must first drop the attempt that is running."""
        return self.state in _RECEIVING and attempt != self.attempts.current

    def switches_form(self, layout: KVLayout) -> bool:
        """A BEGIN announcing `layout` starts an attempt in the other form of the
        expected layout: its rows are counted anew, so no writer may be inside."""
        return self.state not in _RECEIVING and layout != self.layout

    def joins_differently(self, attempt: bytes, layout: KVLayout, num_senders: int) -> str:
        """Why a BEGIN of the running attempt disagrees with the attempt's first
        BEGIN (every sender of one attempt announces the same layout and number
        of senders); "" when it agrees or starts an attempt."""
        if self.state not in _RECEIVING or attempt != self.attempts.current:
            return ""
        if layout != self.layout:
            return (f"a sender of this attempt sends {layout.describe()}, another "
                    f"{self.layout.describe()}")
        if num_senders != self.num_senders:
            return (f"a sender of this attempt says {num_senders} senders, another "
                    f"{self.num_senders}")
        return ""

    def start_attempt(self, attempt: bytes, peer: Peer, layout: KVLayout | None = None,
                      num_senders: int = 1) -> None:  # fmt: skip
        """BEGIN of `attempt` on `peer`: EXPECTED/SENDER_LOST -> STARTED with it as
        the current attempt (of `num_senders` senders, writing `layout`: the
        expected layout or its other form, `switches_form` having been waited
        out); on a running attempt, `peer` joins it."""
        if self.state in (TransferState.EXPECTED, TransferState.SENDER_LOST):
            self.state = self.state.to(TransferState.STARTED)
            self.attempts.start(attempt)
            self.num_senders = num_senders
            if layout is not None and layout != self.layout:
                assert not self.writes.writers, "a writer is inside while the form changes"
                self.layout = layout
                self.writes = LandingWrites(layout, self.writes.data)
            if self.transfer_timeout_s is not None:  # the transfer's clock starts now
                self.deadline = min(self.reservation_deadline,
                                    time.time() + self.transfer_timeout_s)
        self.attempts.join(peer)

    def runs_attempt(self, epoch: int) -> bool:
        """Attempt `epoch` is the current one and still receiving."""
        return self.attempts.epoch == epoch and self.state in _RECEIVING

    def drop_attempt(self) -> list[Peer]:
        """The current attempt's sender is lost: -> SENDER_LOST, its progress is
        reset (buffer, ticket and deadline stay); returns its streams."""
        self.state = self.state.to(TransferState.SENDER_LOST)
        self.deadline = self.reservation_deadline  # waiting for a sender again
        stale = self.attempts.drop()
        self.writes.reset()
        self.next_layer = 0
        self.end_peers = []
        self.end_total = 0
        return stale

    # ---------------------------------------------------------------- progress

    def end(self, peer: Peer, first_token_id: int, total_bytes: int) -> str:
        """END of one sender on `peer`: STARTED -> ENDING at the first; "" if it
        was accepted, else why not (a second END on `peer`, more ENDs than
        senders, a first token other senders did not send)."""
        if self.state not in _RECEIVING or any(p is peer for p in self.end_peers):
            return "second END"
        if len(self.end_peers) >= self.num_senders:
            return f"END number {len(self.end_peers) + 1} of {self.num_senders} senders"
        if self.end_peers and first_token_id != self.first_token_id:
            return (f"END's first token {first_token_id} differs from another sender's "
                    f"{self.first_token_id}")
        if self.state is TransferState.STARTED:
            self.state = self.state.to(TransferState.ENDING)
        self.end_peers.append(peer)
        self.first_token_id = first_token_id
        self.end_total = total_bytes
        return ""

    def take_ready_layer(self) -> int | None:
        """The next layer to deliver, if all its rows landed (layers go in order)."""
        layer = self.next_layer
        if (
            layer >= self.layout.num_layers
            or self.writes.layer_rows[layer] != self.layout.rows_per_layer
        ):
            return None
        self.next_layer += 1
        self.delivered_any = True
        return layer

    def complete(self) -> bool:
        """ENDING with every sender's END in and every layer delivered -> COMPLETE;
        False otherwise."""
        if (self.state is not TransferState.ENDING or len(self.end_peers) < self.num_senders
                or self.next_layer < self.layout.num_layers):  # fmt: skip
            return False
        self.state = self.state.to(TransferState.COMPLETE)
        self.finished_at = time.time()
        return True

    def fail(self, reason: str) -> bool:
        """-> FAILED with `reason`; False if it already ended."""
        if self.state.terminal:
            return False
        self.state = self.state.to(TransferState.FAILED)
        self.reason = reason
        self.finished_at = time.time()
        return True

    def expired(self, now: float) -> bool:
        return not self.state.terminal and now > self.deadline

    def expiry_detail(self) -> str:
        """Why `expired` is true, naming the phase whose deadline passed."""
        if self.transfer_timeout_s is None:
            return f"deadline {self.deadline:.3f} passed"
        if self.state not in _RECEIVING:
            return f"no sender began before the reservation's deadline {self.deadline:.3f}"
        if self.deadline < self.reservation_deadline:
            return (f"the transfer did not finish within the {self.transfer_timeout_s:g}s "
                    "transfer timeout of its BEGIN")
        return f"the transfer did not finish by the reservation's deadline {self.deadline:.3f}"

    # ---------------------------------------------------------------- the buffer

    def release(self) -> bool:
        """The consumer is done with the views; True if the transfer was still running."""
        self.released = True
        return not self.state.terminal

    def take_buffer(self, now: float, claim_grace_s: float) -> tuple[LandingBuffer, bool] | None:
        """-> RELEASED, handing back the buffer, once it ended, no writer is inside,
        and the consumer released it (or nothing was ever handed out, or
        `claim_grace_s` passed since the end). None while it must stay. The bool
        says it was freed unclaimed (the consumer never said it was done)."""
        if self.buffer is None or self.writes.writers or not self.state.terminal:
            return None
        grace_over = now > self.finished_at + claim_grace_s
        if self.state is TransferState.COMPLETE:
            free = self.released or grace_over
        else:
            free = self.released or not self.delivered_any or grace_over
        if not free:
            return None
        unclaimed = not self.released and (
            self.state is TransferState.COMPLETE or self.delivered_any
        )
        buffer, self.buffer = self.buffer, None
        self.state = self.state.to(TransferState.RELEASED)
        return buffer, unclaimed

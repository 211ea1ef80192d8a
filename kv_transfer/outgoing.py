"""Sender-side bookkeeping shared by the connectors: slicing and the outcome.

`plan_pieces` turns one `send_layer` call into row-aligned DATA pieces. An
`Outgoing` is one transfer on the sender: its state machine, the count of
queued-but-unsent frames (END goes out only when it reaches zero, so END
follows every DATA on every stream), and the future the engine waits on.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import torch

from kv_transfer.base import KVLayout, TransferOutcome, TransferState, TransferTarget
from kv_transfer.errors import InvalidTransition
from kv_transfer.layout import SenderPart
from kv_transfer.wire import MAX_ATTEMPT_BYTES


@dataclass(frozen=True, slots=True)
class Piece:
    """One DATA frame: `length` bytes from byte `src_start` of the staged chunk go to
    byte `offset` of `layer` in the transfer layout."""

    layer: int
    offset: int
    src_start: int
    length: int


def plan_pieces(layout: KVLayout, layer: int, token_start: int, num_tokens: int,
                num_streams: int, max_chunk_bytes: int, min_chunk_bytes: int = 0,
                heads: tuple[int, int] | None = None) -> list[Piece]:  # fmt: skip
    """Slice tokens [token_start, token_start + num_tokens) of heads `heads`
    (layout-local, None = all) of one layer.

    The staged chunk is `layout.staged(kv)`'s bytes and `layout.chunk_runs` says
    where its rows land. Whole-model form: [2, n, H, D], its K rows are bytes
    [0, n*row), its V rows [n*row, 2n*row); K goes to `token_start*row`, V to
    `(T + token_start)*row`; a whole layer (n = T) is laid out exactly as it
    lands, so its 2n rows are one run. Head-ranged form: [h, 2, n, D], two runs
    per head (one for all heads when n = T). Runs are cut into pieces of whole
    rows, about one per stream (so one layer spreads over all streams), never
    above max_chunk_bytes and, unless the run itself is shorter, never below
    min_chunk_bytes: the fewer and larger the frames, the less per-frame work
    on both sides (with more streams than that allows, the pieces of
    successive layers rotate over the streams).
    """
    row = layout.row_bytes
    runs = layout.chunk_runs(token_start, num_tokens, heads)
    total_rows = sum(rows for _, _, rows in runs)
    per_stream = max(-(-total_rows // num_streams), min_chunk_bytes // row)
    rows_per_piece = max(1, min(per_stream, max_chunk_bytes // row))
    pieces = []
    for src_row, dest_row, run_rows in runs:
        for first in range(0, run_rows, rows_per_piece):
            rows = min(rows_per_piece, run_rows - first)
            pieces.append(Piece(layer, (dest_row + first) * row, (src_row + first) * row,
                                rows * row))  # fmt: skip
    return pieces


class Outgoing:
    """One transfer on the sender. `pending` and `end_first_token` are guarded by
    `lock`; the outcome is set once, by whoever decides first."""

    __slots__ = ("request_id", "target", "layout", "part", "state", "pending",
                 "end_first_token", "end_queued", "future", "lock", "next_stream", "resolved",
                 "attempt")  # fmt: skip

    def __init__(self, request_id: str, target: TransferTarget, layout: KVLayout,
                 heads: tuple[int, int] | None = None, attempt: bytes | None = None,
                 num_senders: int = 1) -> None:  # fmt: skip
        """`heads`, `attempt`, `num_senders` as `KVSender.begin` takes them;
        ValueError if they do not fit `layout`."""
        start, end = layout.heads(heads)
        part = SenderPart(start, end, num_senders)
        if not part.fits(layout):
            raise ValueError(f"{num_senders} senders of a whole-model layout: only a "
                             "head-ranged layout (model_kv_heads > 0) has several")
        if attempt is not None and not (
                isinstance(attempt, bytes) and 0 < len(attempt) <= MAX_ATTEMPT_BYTES):  # fmt: skip
            raise ValueError(f"attempt must be 1..{MAX_ATTEMPT_BYTES} bytes, got {attempt!r}")
        self.request_id = request_id
        self.target = target
        self.layout = layout
        self.part = part  # the heads this sender writes, of how many senders
        self.state = TransferState.STARTED
        self.pending = 0
        self.end_first_token: int | None = None
        self.end_queued = False
        self.future: Future[TransferOutcome] = Future()
        self.lock = threading.Lock()
        self.next_stream = 0  # round-robin start for the next piece
        self.resolved = False
        # this sending attempt's id, on every stream's BEGIN: the receiver tells a
        # retry from another pod (new id) from this attempt's other streams (same
        # id), and from its other senders (other prefill ranks: the id they share)
        self.attempt = attempt if attempt is not None else os.urandom(8)

    @property
    def done(self) -> bool:
        return self.resolved

    def plan(self, layer: int, kv: torch.Tensor, token_start: int, num_streams: int,
             max_chunk_bytes: int, min_chunk_bytes: int) -> list[Piece]:  # fmt: skip
        """Check `send_layer`'s chunk (ValueError) and slice it (`plan_pieces`); the
        bytes to send are `self.layout.staged(kv)`'s."""
        self.layout.check_chunk(layer, kv, token_start, self.part.heads)
        return plan_pieces(self.layout, layer, token_start, kv.shape[1], num_streams,
                           max_chunk_bytes, min_chunk_bytes, self.part.heads)  # fmt: skip

    def add_pending(self, count: int) -> None:
        with self.lock:
            self.pending += count

    def request_end(self, first_token_id: int) -> bool:
        """Record END; True if END may be queued now (nothing pending)."""
        with self.lock:
            if self.end_first_token is not None:
                raise ValueError(f"end() called twice for {self.request_id!r}")
            if self.state is TransferState.STARTED:
                self.state = self.state.to(TransferState.ENDING)
            self.end_first_token = first_token_id
            return self._take_end()

    def piece_done(self) -> bool:
        """A queued frame was sent or dropped; True if END should be queued now."""
        with self.lock:
            self.pending -= 1
            return self._take_end()

    def _take_end(self) -> bool:
        if self.pending or self.end_first_token is None or self.end_queued or self.done:
            return False
        self.end_queued = True
        self.pending += 1  # the END frame itself
        return True

    def resolve(self, outcome: TransferOutcome) -> bool:
        """Set the outcome once; False if it was already set."""
        with self.lock:
            if self.resolved:
                return False
            self.resolved = True
            new = TransferState.COMPLETE if outcome.ok else TransferState.FAILED
            try:
                self.state = self.state.to(new)
            except InvalidTransition:
                # COMPLETE needs END first: a receiver claiming success before END is lying
                self.state = self.state.to(TransferState.FAILED)
                outcome = TransferOutcome.failed("bad_frame: verdict before END")
        try:
            self.future.set_result(outcome)  # outside the lock: callbacks run here
        except InvalidStateError:
            # the caller gave up on the verdict (asyncio.wrap_future cancels the
            # future when the awaiting RPC is cancelled): nobody is waiting
            pass
        return True

"""The receiver's transfer table: transport-independent bookkeeping of incoming KV.

Both connectors (TCP, gRPC) drive one `ReceiveTable`: their I/O threads call
`begin` / `claim` + `commit` / `end` / `abort` as frames arrive, the service
calls `expect` / `release` / `cancel`, and the sweeper calls `sweep`.

Per transfer (see `TransferState`):

    expect  -> EXPECTED, landing buffer allocated, ticket issued (valid until the
               reservation's deadline)
    BEGIN   -> STARTED   (each stream's BEGIN authenticates that stream: `peer`;
               its layout must be the expected one, or a whole-model layout's
               head-major form (`KVLayout.accepts`), else `layout_mismatch`
               naming both sides. The first BEGIN of an attempt fixes its form
               and its number of senders: several senders (prefill ranks) of
               one head-ranged layout share the attempt id, each writing its
               own heads)
    DATA    -> rows claimed (no two writers ever touch the same bytes), payload
               written by the transport straight into the buffer, then committed
               (checksum verdict); complete layers are delivered in layer order
    END     -> ENDING (each sender sends one); COMPLETE once every sender's END
               is in (same first token), every row landed and the byte count
               matches; the verdict goes to every stream that carried an END
    sender lost (its stream broke or it sent ABORT before END)
            -> SENDER_LOST: the attempt's streams are dropped, progress is reset
               (`on_restart`), buffer, ticket and deadline stay
    BEGIN of another attempt (new attempt id, valid ticket)
            -> STARTED again, layers from 0; from STARTED/ENDING it supersedes the
               running attempt first (the new pod's BEGIN may beat the old
               connection's close). Frames from a dropped attempt's streams are
               refused as `superseded` (counted in `stale_frames`), never applied
    deadline (per phase when `expect` got a transfer timeout): EXPECTED and
               SENDER_LOST (waiting for a sender, e.g. while the prefill is
               queued) until the reservation's deadline; STARTED/ENDING until
               min(that, the attempt's BEGIN + transfer timeout); past it -> FAILED
    failure -> FAILED from any non-terminal state; every authenticated peer is told
    free    -> RELEASED, once terminal AND no writer is inside the buffer AND
               (the consumer released it, or nothing was ever handed out, or the
               claim grace period passed: the sweeper then counts it unclaimed)

Invariant: a landing buffer is returned to the pool only when no writer is
inside it, so no receiver thread can write into memory that was handed to
another transfer. A dropped attempt's writer still inside the buffer keeps its
rows DRAINING (`RowState`): the next attempt's claim of those rows waits for
it (`_cond`), so stale bytes never land over the new attempt's.

Locking: `_lock` guards the table and every transfer's state; a transfer's
`deliver_lock` (re-entrant) serialises listener calls for that transfer, so
layers arrive in order and `on_failed` never overtakes an `on_layer_ready`.
Listener calls and peer notifications happen outside `_lock`.

The parts: this module is the entry points; `Transfers` (transfers.py) holds
the transfers, tombstones (tombstones.py) and counters, and the steps the
entry points share (deliver, fail, restart, free); one transfer is an
`Incoming` (incoming.py) with its `Attempts` (attempts.py) and its
`LandingWrites` (writes.py, rows as `RowState`, row_state.py).
"""

from __future__ import annotations

import threading
import time

from kv_transfer.attempts import Peer
from kv_transfer.base import (
    KVLayout,
    KVReceiveListener,
    ReceiverStats,
    TransferTarget,
)
from kv_transfer.errors import Reason, TransferRefused, make_reason, reason_code
from kv_transfer.incoming import Incoming
from kv_transfer.landing import LandingBufferPool
from kv_transfer.layout import SenderPart
from kv_transfer.tickets import TicketAuthority
from kv_transfer.tombstones import ended_refusal
from kv_transfer.transfers import Transfers
from kv_transfer.writes import WriteClaim
from proto.request_id import check_request_id

_ENDED_KEPT = 4096


class ReceiveTable:
    def __init__(self, pool: LandingBufferPool, authority: TicketAuthority,
                 listener: KVReceiveListener, *, transport: str,
                 claim_grace_s: float = 30.0) -> None:  # fmt: skip
        if not 0 < claim_grace_s <= 3600:
            raise ValueError(f"claim_grace_s must be in (0, 3600], got {claim_grace_s}")
        self.pool = pool
        self.authority = authority
        self.listener = listener
        self.transport = transport
        self.claim_grace_s = claim_grace_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # a dropped writer left the buffer
        self._transfers = Transfers(self._lock, listener, pool, claim_grace_s, _ENDED_KEPT)

    # ---------------------------------------------------------------- service side

    def expect(self, request_id: str, layout: KVLayout, deadline: float,
               endpoints: tuple[str, ...],
               transfer_timeout_s: float | None = None) -> TransferTarget:  # fmt: skip
        check_request_id(request_id)
        if deadline <= time.time():
            raise ValueError(f"deadline {deadline:.3f} is already in the past")
        if transfer_timeout_s is not None and not transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0 seconds, got {transfer_timeout_s}")
        with self._lock:
            if self._transfers.get(request_id) is not None:
                raise ValueError(f"request {request_id!r} already has a transfer")
        buffer = self.pool.allocate(layout.total_bytes)  # may raise BufferPoolExhausted
        with self._lock:
            if self._transfers.get(request_id) is not None:
                self.pool.free(buffer)
                raise ValueError(f"request {request_id!r} already has a transfer")
            self._transfers.add(Incoming(request_id, layout, deadline, buffer,
                                         transfer_timeout_s))
        return TransferTarget(
            endpoints=endpoints,
            ticket=self.authority.issue(request_id, deadline),
            transport=self.transport,
            generation=self.authority.generation,
            deadline=deadline,
        )

    def release(self, request_id: str) -> bool:
        with self._lock:
            t = self._transfers.get(request_id)
            if t is None:
                return False
            running = t.release()
        if running:
            self._transfers.fail(t, make_reason(Reason.CANCELLED, "released before completion"))
        self._transfers.free(t)
        return True

    def cancel(self, request_id: str, reason: str) -> bool:
        with self._lock:
            t = self._transfers.get(request_id)
        if t is None:
            return False
        return self._transfers.fail(t, make_reason(Reason.CANCELLED, reason))

    def deadline_of(self, request_id: str) -> float:
        """The transfer's deadline (now, if it is unknown or already gone)."""
        with self._lock:
            t = self._transfers.get(request_id)
            return t.deadline if t is not None else time.time()

    def stats(self) -> ReceiverStats:
        with self._lock:
            return self._transfers.counts.snapshot(self.pool, len(self._transfers))

    # ---------------------------------------------------------------- I/O threads

    def authenticate(self, request_id: str, ticket: bytes) -> None:
        """A connection's first BEGIN, before it may cost a thread (the TCP
        port's lobby): raises TransferRefused if `ticket` does not admit
        `request_id`, failing the transfer as `begin` would."""
        try:
            self.authority.verify(ticket, request_id)
        except TransferRefused as refused:
            with self._lock:
                t = self._transfers.get(request_id)
                ended = self._transfers.tombstone(request_id)
            if t is not None or ended is None:
                self._transfers.refuse(t, refused, request_id)
            raise

    def begin(self, request_id: str, ticket: bytes, layout: KVLayout, peer: Peer,
              attempt: bytes = b"", part: SenderPart | None = None) -> None:  # fmt: skip
        """Authenticate `peer` for `request_id` as a stream of sending attempt
        `attempt` (all streams of one attempt carry the same id, and so do all
        `part.num_senders` senders of a head-ranged transfer); a new id starts a
        new attempt, superseding a running one. Raises TransferRefused."""
        part = part or SenderPart.whole(layout)
        with self._lock:
            t = self._transfers.get(request_id)
            ended = self._transfers.tombstone(request_id)
        try:
            self.authority.verify(ticket, request_id)
        except TransferRefused as refused:
            # the ticket's own verdict goes back even when the transfer already ended
            # (then it was counted when it ended: refuse without counting again)
            if t is not None or ended is None:
                self._transfers.refuse(t, refused, request_id)
            raise
        if t is None and ended is not None:
            if ended.completed_by_attempt(attempt):
                return  # a late stream of the attempt that completed it (see below)
            raise ended.refusal()
        try:
            if t is None:
                raise TransferRefused(Reason.UNKNOWN_REQUEST, f"{request_id!r} is not expected")
            _check_layout(t.expected, layout, part)
        except TransferRefused as refused:
            self._transfers.refuse(t, refused, request_id)
            raise
        # deliver_lock first: a superseded attempt's on_restart must reach the
        # consumer before any layer of the new attempt can
        with t.deliver_lock:
            with self._lock:
                if t.state.terminal:
                    if t.tombstone().completed_by_attempt(attempt):
                        # The attempt that completed the transfer opened this stream too
                        # but sent nothing on it (a small transfer spans fewer streams);
                        # its BEGIN lost the race with the others' frames. Nothing to
                        # authenticate any more, and nothing to refuse: a refusal would
                        # reach the sender as a failure, maybe before the verdict.
                        return
                    raise ended_refusal(t.reason)
                if t.attempts.is_retired(attempt):
                    self._transfers.counts.stale_frames += 1
                    raise TransferRefused(Reason.SUPERSEDED,
                                          f"attempt of {request_id!r} was dropped")  # fmt: skip
                differs = t.joins_differently(attempt, layout, part.num_senders)
                stale: list[Peer] | None = None
                if not differs and t.superseded_by(attempt):
                    stale = t.drop_attempt()
                    self._transfers.counts.senders_lost += 1
                # the other form's rows are counted anew: a dropped attempt's writer
                # must leave first (bounded: its stream's I/O timeout)
                while not differs and t.switches_form(layout) and t.writes.writers:
                    self._cond.wait(0.5)
                if t.state.terminal:
                    raise ended_refusal(t.reason)
                if not differs:
                    t.start_attempt(attempt, peer, layout, part.num_senders)
            if differs:
                refused = TransferRefused(Reason.LAYOUT_MISMATCH, differs)
                self._transfers.refuse(t, refused, request_id)
                raise refused
            if stale is not None:
                reason = make_reason(Reason.SENDER_LOST, "superseded by a new attempt")
                self._transfers.restarted(t, reason, stale)

    def claim(self, request_id: str, peer: Peer, layer: int, offset: int,
              length: int) -> WriteClaim:  # fmt: skip
        """Reserve the landing bytes of one DATA frame; raises TransferRefused."""
        with self._lock:
            t = self._transfers.authenticated(request_id, peer)
            while True:
                try:
                    claim = t.writes.claim(t, t.attempts.epoch, layer, offset, length)
                except TransferRefused as exc:  # bad_frame, duplicate_data
                    refused = exc
                    break
                if claim is not None:
                    return claim
                # a dropped attempt's writer is still in these rows: wait for its
                # commit (bounded: its stream's I/O timeout), then look again
                self._cond.wait(0.5)
                t = self._transfers.authenticated(request_id, peer)
        self._transfers.refuse(t, refused, request_id)
        raise refused

    def commit(self, claim: WriteClaim, failure: str | None = None) -> None:
        """The transport finished writing `claim.view`: `failure` None means the bytes
        verified; otherwise it is the reason the region cannot be trusted: a bad
        checksum fails the transfer, a connection lost mid-payload drops the
        attempt. A claim of a dropped attempt only leaves the buffer."""
        t = claim.transfer
        with self._lock:
            landed = failure is None and not t.state.terminal
            current = t.writes.commit(claim, t.attempts.epoch, landed)
            if not current:  # its rows were DRAINING: a waiting claim may go on
                self._cond.notify_all()
            elif landed:
                self._transfers.counts.bytes_received += len(claim.view)
        if not current:
            pass
        elif failure is not None and reason_code(failure) == Reason.CONNECTION_LOST.value:
            self._transfers.drop_current(t, make_reason(Reason.SENDER_LOST, failure), claim.epoch)
        elif failure is not None:
            self._transfers.fail(t, failure)
        else:
            self._transfers.advance(t)
        self._transfers.free(t)

    def end(self, request_id: str, peer: Peer, first_token_id: int, total_bytes: int) -> None:
        """END of one sender arrived on `peer`; the verdict goes back to it once
        decided (COMPLETE: every sender's END in and every row landed)."""
        with self._lock:
            t = self._transfers.authenticated(request_id, peer)
            refused = t.end(peer, first_token_id, total_bytes)
        if refused:
            self._transfers.refuse(t, TransferRefused(Reason.BAD_FRAME, refused), request_id)
        elif total_bytes != t.layout.total_bytes:
            self._transfers.fail(t, make_reason(
                Reason.SIZE_MISMATCH, f"END says {total_bytes} bytes, layout has "
                f"{t.layout.total_bytes}"))  # fmt: skip
        else:
            self._transfers.advance(t)
        self._transfers.free(t)

    def abort(self, request_id: str, peer: Peer, reason: str) -> None:
        """ABORT from a peer of the current attempt: the sender gave up, so the
        attempt is dropped and the transfer waits for another BEGIN (the deadline
        still bounds it). Ignored after the end or from a dropped attempt."""
        with self._lock:
            t = self._transfers.get(request_id)
            if t is not None and t.attempts.dropped(peer):
                return
            if t is not None and t.state.terminal and t.attempts.carries(peer):
                return
            t = self._transfers.authenticated(request_id, peer)
            epoch = t.attempts.epoch
        self._transfers.drop_current(t, make_reason(Reason.SENDER_LOST, f"aborted: {reason}"),
                                     epoch)  # fmt: skip

    def peer_lost(self, peer: Peer, reason: str) -> None:
        """`peer`'s stream broke: the attempts it carried can never finish, so each
        of its transfers drops that attempt and waits for another BEGIN."""
        with self._lock:
            lost = [
                (t, t.attempts.epoch) for t in self._transfers.live()
                if not t.state.terminal and t.attempts.carries(peer)
            ]  # fmt: skip
        for t, epoch in lost:
            self._transfers.drop_current(t, make_reason(Reason.SENDER_LOST, reason), epoch)

    def stale_frame(self) -> None:
        """A transport dropped a frame of a superseded attempt before asking the table."""
        with self._lock:
            self._transfers.counts.stale_frames += 1

    # ---------------------------------------------------------------- sweeper

    def sweep(self, now: float) -> None:
        """Fail transfers past their deadline; free buffers whose time came."""
        with self._lock:
            transfers = self._transfers.live()
        for t in transfers:
            if t.expired(now):
                with self._lock:
                    detail = t.expiry_detail()
                passed = make_reason(Reason.DEADLINE, detail)
                self._transfers.fail(t, passed)
            self._transfers.free(t, now)

    def close(self) -> None:
        """Fail everything and free every buffer no writer is inside (transports stop
        their I/O threads first, so that is all of them)."""
        with self._lock:
            transfers = self._transfers.live()
        for t in transfers:
            self._transfers.fail(t, make_reason(Reason.CLOSED))
            with self._lock:
                t.release()
            self._transfers.free(t)


def _check_layout(expected: KVLayout, sent: KVLayout, part: SenderPart) -> None:
    """TransferRefused(layout_mismatch) naming both sides' values unless a BEGIN
    announcing `sent` and `part` may fill a transfer expected as `expected`."""
    if not expected.accepts(sent):
        raise TransferRefused(Reason.LAYOUT_MISMATCH, f"prefill sends {sent.describe()}, "
                                                      f"decode expects {expected.describe()}")
    if not part.fits(sent):
        raise TransferRefused(Reason.LAYOUT_MISMATCH,
                              f"prefill sends heads [{part.sub_start}, {part.sub_end}) of "
                              f"{sent.describe()}")  # fmt: skip

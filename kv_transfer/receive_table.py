"""The receiver's transfer table: transport-independent bookkeeping of incoming KV.

Both connectors (TCP, gRPC) drive one `ReceiveTable`: their I/O threads call
`begin` / `claim` + `commit` / `end` / `abort` as frames arrive, the service
calls `expect` / `release` / `cancel`, and the collector calls `sweep`.

Per transfer (see `TransferState`):

    expect  -> EXPECTED, landing buffer allocated, ticket issued
    BEGIN   -> STARTED   (each stream's BEGIN authenticates that stream: `peer`)
    DATA    -> rows claimed (no two writers ever touch the same bytes), payload
               written by the transport straight into the buffer, then committed
               (checksum verdict); complete layers are delivered in layer order
    END     -> ENDING; COMPLETE once every row landed and the byte count matches
    sender lost (its stream broke or it sent ABORT before END)
            -> SENDER_LOST: the attempt's streams are dropped, progress is reset
               (`on_restart`), buffer, ticket and deadline stay
    BEGIN of another attempt (new attempt id, valid ticket)
            -> STARTED again, layers from 0; from STARTED/ENDING it supersedes the
               running attempt first (the new pod's BEGIN may beat the old
               connection's close). Frames from a dropped attempt's streams are
               refused as `superseded` (counted in `stale_frames`), never applied
    failure -> FAILED from any non-terminal state; every authenticated peer is told
    free    -> RELEASED, once terminal AND no writer is inside the buffer AND
               (the consumer released it, or nothing was ever handed out, or the
               claim grace period passed: the collector then counts it unclaimed)

Invariant: a landing buffer is returned to the pool only when `writers == 0`,
so no receiver thread can write into memory that was handed to another transfer.
A dropped attempt's writer still inside the buffer keeps its rows marked busy:
the next attempt's claim of those rows waits for it (`_cond`), so stale bytes
never land over the new attempt's.

Locking: `_lock` guards the table and every transfer's counters; a transfer's
`deliver_lock` (re-entrant) serialises listener calls for that transfer, so
layers arrive in order and `on_failed` never overtakes an `on_layer_ready`.
Listener calls and peer notifications happen outside `_lock`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from kv_transfer.base import (
    KVLayout,
    KVReceiveListener,
    ReceiverStats,
    TransferOutcome,
    TransferState,
    TransferTarget,
    check_request_id,
)
from kv_transfer.ended import Ended, EndedTransfers, ended_refusal
from kv_transfer.errors import Reason, TransferRefused, make_reason, reason_code
from kv_transfer.incoming import Incoming, Peer, WriteClaim
from kv_transfer.landing import LandingBufferPool
from kv_transfer.tickets import TicketAuthority

log = logging.getLogger(__name__)
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
        self._senders_lost = 0
        self._stale_frames = 0
        self._transfers: dict[str, Incoming] = {}
        self._failures: Counter[str] = Counter()
        self._completed = 0
        self._bytes_received = 0
        self._unclaimed_freed = 0
        # recently freed transfers: frames still in flight on other streams are
        # refused as "ended", not counted again
        self._ended = EndedTransfers(_ENDED_KEPT)

    # ---------------------------------------------------------------- service side

    def expect(self, request_id: str, layout: KVLayout, deadline: float,
               endpoints: tuple[str, ...]) -> TransferTarget:  # fmt: skip
        check_request_id(request_id)
        if deadline <= time.time():
            raise ValueError(f"deadline {deadline:.3f} is already in the past")
        with self._lock:
            if request_id in self._transfers:
                raise ValueError(f"request {request_id!r} already has a transfer")
        buffer = self.pool.allocate(layout.total_bytes)  # may raise BufferPoolExhausted
        with self._lock:
            if request_id in self._transfers:
                self.pool.free(buffer)
                raise ValueError(f"request {request_id!r} already has a transfer")
            self._transfers[request_id] = Incoming(request_id, layout, deadline, buffer)
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
            t.released = True
            running = not t.state.terminal
        if running:
            self._fail(t, make_reason(Reason.CANCELLED, "released before completion"))
        self._maybe_free(t)
        return True

    def cancel(self, request_id: str, reason: str) -> bool:
        with self._lock:
            t = self._transfers.get(request_id)
        if t is None:
            return False
        return self._fail(t, make_reason(Reason.CANCELLED, reason))

    def deadline_of(self, request_id: str) -> float:
        """The transfer's deadline (now, if it is unknown or already gone)."""
        with self._lock:
            t = self._transfers.get(request_id)
            return t.deadline if t is not None else time.time()

    def stats(self) -> ReceiverStats:
        with self._lock:
            return ReceiverStats(
                bytes_in_use=self.pool.bytes_in_use,
                capacity_bytes=self.pool.capacity_bytes,
                active_transfers=len(self._transfers),
                completed=self._completed,
                bytes_received=self._bytes_received,
                failures=dict(self._failures),
                unclaimed_freed=self._unclaimed_freed,
                senders_lost=self._senders_lost,
                stale_frames=self._stale_frames,
            )

    # ---------------------------------------------------------------- I/O threads

    def begin(self, request_id: str, ticket: bytes, layout: KVLayout, peer: Peer,
              attempt: bytes = b"") -> None:  # fmt: skip
        """Authenticate `peer` for `request_id` as a stream of sending attempt
        `attempt` (all streams of one attempt carry the same id); a new id starts a
        new attempt, superseding a running one. Raises TransferRefused."""
        with self._lock:
            t = self._transfers.get(request_id)
            ended = self._ended.get(request_id)
        try:
            self.authority.verify(ticket, request_id)
        except TransferRefused as refused:
            # the ticket's own verdict goes back even when the transfer already ended
            # (then it was counted when it ended: refuse without counting again)
            if t is not None or ended is None:
                self._refuse(t, refused, request_id)
            raise
        if t is None and ended is not None:
            if ended.completed_by_attempt(attempt):
                return  # a late stream of the attempt that completed it (see below)
            raise ended.refusal()
        try:
            if t is None:
                raise TransferRefused(Reason.UNKNOWN_REQUEST, f"{request_id!r} is not expected")
            if layout != t.layout:
                raise TransferRefused(
                    Reason.LAYOUT_MISMATCH, f"sender has {layout}, receiver expects {t.layout}"
                )
        except TransferRefused as refused:
            self._refuse(t, refused, request_id)
            raise
        # deliver_lock first: a superseded attempt's on_restart must reach the
        # consumer before any layer of the new attempt can
        with t.deliver_lock:
            with self._lock:
                if t.state.terminal:
                    if Ended.of(t.reason, t.attempt).completed_by_attempt(attempt):
                        # The attempt that completed the transfer opened this stream too
                        # but sent nothing on it (a small transfer spans fewer streams);
                        # its BEGIN lost the race with the others' frames. Nothing to
                        # authenticate any more, and nothing to refuse: a refusal would
                        # reach the sender as a failure, maybe before the verdict.
                        return
                    raise ended_refusal(t.reason)
                if attempt in t.retired:
                    self._stale_frames += 1
                    raise TransferRefused(Reason.SUPERSEDED,
                                          f"attempt of {request_id!r} was dropped")  # fmt: skip
                stale: list[Peer] | None = None
                if t.state in _RECEIVING and attempt != t.attempt:
                    stale = self._drop_attempt(t)
                if t.state in (TransferState.EXPECTED, TransferState.SENDER_LOST):
                    t.state = t.state.to(TransferState.STARTED)
                    t.attempt = attempt
                # a persistent connection may carry a later attempt after a dropped one:
                # frames are ordered on it, so everything after this BEGIN is current
                t.stale_peers = [p for p in t.stale_peers if p is not peer]
                if not any(p is peer for p in t.peers):
                    t.peers.append(peer)
            if stale is not None:
                self._restarted(t, make_reason(Reason.SENDER_LOST, "superseded by a new attempt"),
                                stale)  # fmt: skip

    def claim(self, request_id: str, peer: Peer, layer: int, offset: int,
              length: int) -> WriteClaim:  # fmt: skip
        """Reserve the landing bytes of one DATA frame; raises TransferRefused."""
        with self._lock:
            t = self._authenticated(request_id, peer)
            lay = t.layout
            row = lay.row_bytes
            bad = (
                layer >= lay.num_layers or length <= 0 or offset % row or length % row
                or offset + length > lay.bytes_per_layer
            )  # fmt: skip
            if not bad:
                first = layer * lay.rows_per_layer + offset // row
                num_rows = length // row
                while t.rows.find(2, first, first + num_rows) >= 0:
                    # a dropped attempt's writer is still in these rows: wait for its
                    # commit (bounded: its stream's I/O timeout), then look again
                    self._cond.wait(0.5)
                    t = self._authenticated(request_id, peer)
                duplicate = t.rows.count(1, first, first + num_rows) > 0
                if not duplicate:
                    t.rows[first : first + num_rows] = b"\x01" * num_rows
                    t.writers += 1
                    start = layer * lay.bytes_per_layer + offset
                    claim = WriteClaim(request_id, layer, num_rows,
                                       t.bytes[start : start + length], t, first,
                                       t.epoch)  # fmt: skip
                    t.inflight[id(claim)] = claim
                    return claim
        if bad:
            refused = TransferRefused(
                Reason.BAD_FRAME,
                f"DATA layer {layer} offset {offset} length {length} does not fit {lay}",
            )
        else:
            refused = TransferRefused(Reason.DUPLICATE_DATA, f"layer {layer} offset {offset}")
        self._refuse(t, refused, request_id)
        raise refused

    def commit(self, claim: WriteClaim, failure: str | None = None) -> None:
        """The transport finished writing `claim.view`: `failure` None means the bytes
        verified; otherwise it is the reason the region cannot be trusted: a bad
        checksum fails the transfer, a connection lost mid-payload drops the
        attempt. A claim of a dropped attempt only leaves the buffer."""
        t = claim._transfer
        with self._lock:
            t.writers -= 1
            del t.inflight[id(claim)]
            stale = claim.epoch != t.epoch
            if stale:  # its rows were marked busy when its attempt was dropped
                t.rows[claim.first : claim.first + claim.num_rows] = bytes(claim.num_rows)
                self._cond.notify_all()
            elif failure is None and not t.state.terminal:
                t.layer_rows[claim.layer] += claim.num_rows
                self._bytes_received += len(claim.view)
        if stale:
            pass
        elif failure is not None and reason_code(failure) == Reason.CONNECTION_LOST.value:
            self._drop_current(t, make_reason(Reason.SENDER_LOST, failure), claim.epoch)
        elif failure is not None:
            self._fail(t, failure)
        else:
            self._advance(t)
        self._maybe_free(t)

    def end(self, request_id: str, peer: Peer, first_token_id: int, total_bytes: int) -> None:
        """END arrived on `peer`; the verdict goes back to it once decided."""
        with self._lock:
            t = self._authenticated(request_id, peer)
            if t.state is TransferState.STARTED:
                t.state = t.state.to(TransferState.ENDING)
                t.end_peer = peer
                t.first_token_id = first_token_id
                t.end_total = total_bytes
                duplicate = False
            else:
                duplicate = True
        if duplicate:
            self._refuse(t, TransferRefused(Reason.BAD_FRAME, "second END"), request_id)
        elif total_bytes != t.layout.total_bytes:
            self._fail(t, make_reason(
                Reason.SIZE_MISMATCH, f"END says {total_bytes} bytes, layout has "
                f"{t.layout.total_bytes}"))  # fmt: skip
        else:
            self._advance(t)
        self._maybe_free(t)

    def abort(self, request_id: str, peer: Peer, reason: str) -> None:
        """ABORT from a peer of the current attempt: the sender gave up, so the
        attempt is dropped and the transfer waits for another BEGIN (the deadline
        still bounds it). Ignored after the end or from a dropped attempt."""
        with self._lock:
            t = self._transfers.get(request_id)
            if t is not None and any(p is peer for p in t.stale_peers):
                return
            if t is not None and t.state.terminal and any(p is peer for p in t.peers):
                return
            t = self._authenticated(request_id, peer)
            epoch = t.epoch
        self._drop_current(t, make_reason(Reason.SENDER_LOST, f"aborted: {reason}"), epoch)

    def peer_lost(self, peer: Peer, reason: str) -> None:
        """`peer`'s stream broke: the attempts it carried can never finish, so each
        of its transfers drops that attempt and waits for another BEGIN."""
        with self._lock:
            lost = [
                (t, t.epoch) for t in self._transfers.values()
                if not t.state.terminal and any(p is peer for p in t.peers)
            ]  # fmt: skip
        for t, epoch in lost:
            self._drop_current(t, make_reason(Reason.SENDER_LOST, reason), epoch)

    def stale_frame(self) -> None:
        """A transport dropped a frame of a superseded attempt before asking the table."""
        with self._lock:
            self._stale_frames += 1

    # ---------------------------------------------------------------- collector

    def sweep(self, now: float) -> None:
        """Fail transfers past their deadline; free buffers whose time came."""
        with self._lock:
            transfers = list(self._transfers.values())
        for t in transfers:
            if not t.state.terminal and now > t.deadline:
                self._fail(t, make_reason(Reason.DEADLINE, f"deadline {t.deadline:.3f} passed"))
            self._maybe_free(t, now)

    def close(self) -> None:
        """Fail everything and free every buffer no writer is inside (transports stop
        their I/O threads first, so that is all of them)."""
        with self._lock:
            transfers = list(self._transfers.values())
        for t in transfers:
            self._fail(t, make_reason(Reason.CLOSED))
            with self._lock:
                t.released = True
            self._maybe_free(t)

    # ---------------------------------------------------------------- internals

    def _drop_current(self, t: Incoming, reason: str, epoch: int) -> bool:
        """Drop `t`'s attempt `epoch` (sender lost); False if it is no longer current."""
        with t.deliver_lock:
            with self._lock:
                if t.epoch != epoch or t.state not in _RECEIVING:
                    return False
                stale = self._drop_attempt(t)
            self._restarted(t, reason, stale)
        return True

    def _drop_attempt(self, t: Incoming) -> list[Peer]:
        """Caller holds t.deliver_lock and _lock. The current attempt's streams
        become stale, its progress is reset; returns its streams."""
        t.state = t.state.to(TransferState.SENDER_LOST)
        t.retired.add(t.attempt)
        stale, t.peers = t.peers, []
        t.stale_peers.extend(stale)
        t.reset_progress()
        self._senders_lost += 1
        return stale

    def _restarted(self, t: Incoming, reason: str, stale: list[Peer]) -> None:
        """Caller holds t.deliver_lock (not _lock): tell the consumer, then the
        dropped attempt's streams (so a sender that is still alive stops)."""
        log.info("kv transfer %s restarts: %s", t.request_id, reason)
        self._call(t, "on_restart", t.request_id, reason)
        outcome = TransferOutcome.failed(make_reason(Reason.SUPERSEDED, reason))
        for peer in stale:
            peer.notify(t.request_id, outcome)

    def _authenticated(self, request_id: str, peer: Peer) -> Incoming:
        """Caller holds _lock. The transfer, if `peer` sent a valid BEGIN for it
        in the current attempt; a dropped attempt's stream is refused (counted)."""
        t = self._transfers.get(request_id)
        if t is None and request_id in self._ended:
            raise self._ended.get(request_id).refusal()
        if t is not None and not t.state.terminal and any(p is peer for p in t.stale_peers):
            self._stale_frames += 1
            raise TransferRefused(Reason.SUPERSEDED, f"{request_id!r}: this stream's attempt "
                                  "was dropped")  # fmt: skip
        if t is None or not any(p is peer for p in t.peers):
            raise TransferRefused(Reason.UNKNOWN_REQUEST, f"no BEGIN for {request_id!r} here")
        if t.state.terminal:
            raise ended_refusal(t.reason)
        return t

    def _refuse(self, t: Incoming | None, refused: TransferRefused, request_id: str) -> None:
        """A refused frame fails its transfer if there is one (counted once, by the
        first failure); for an unknown transfer it is counted once per request id
        (a tombstone turns the other streams' copies into quiet refusals)."""
        if t is not None:
            self._fail(t, refused.reason)
            return
        with self._lock:
            if request_id not in self._ended:
                self._failures[refused.code.value] += 1
                self._ended.remember(request_id, Ended(refused.reason))

    def _advance(self, t: Incoming) -> None:
        """Deliver every layer that became complete, in order; decide END."""
        with t.deliver_lock:
            while True:
                with self._lock:
                    if t.state.terminal:
                        return
                    layer = t.next_layer
                    if layer < t.layout.num_layers:
                        if t.layer_rows[layer] != t.layout.rows_per_layer:
                            return
                        t.next_layer += 1
                        t.delivered_any = True
                    elif t.state is TransferState.ENDING:
                        t.state = t.state.to(TransferState.COMPLETE)
                        t.finished_at = time.time()
                        self._completed += 1
                        break
                    else:
                        return
                if not self._call(t, "on_layer_ready", t.request_id, layer, t.layer_view(layer)):
                    return
            self._call(t, "on_complete", t.request_id, t.first_token_id)
        if t.end_peer is not None:
            t.end_peer.notify(t.request_id, TransferOutcome.complete())

    def _fail(self, t: Incoming, reason: str) -> bool:
        """Move `t` to FAILED (False if it already ended) and tell everybody."""
        with t.deliver_lock:
            with self._lock:
                if t.state.terminal:
                    return False
                t.state = t.state.to(TransferState.FAILED)
                t.reason = reason
                t.finished_at = time.time()
                self._failures[reason_code(reason)] += 1
                peers = list(t.peers)
            log.info("kv transfer %s failed: %s", t.request_id, reason)
            self._call(t, "on_failed", t.request_id, reason)
        for peer in peers:
            peer.notify(t.request_id, TransferOutcome.failed(reason))
        self._maybe_free(t)
        return True

    def _call(self, t: Incoming, hook: str, *args: object) -> bool:
        """Run a listener hook; a raising listener fails the transfer (not the thread)."""
        try:
            getattr(self.listener, hook)(*args)
            return True
        except Exception:
            log.exception("kv listener %s raised for %s", hook, t.request_id)
            if hook != "on_failed":
                self._fail(t, make_reason(Reason.CANCELLED, f"listener {hook} raised"))
            return False

    def _maybe_free(self, t: Incoming, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            if t.buffer is None or t.writers or not t.state.terminal:
                return
            grace_over = now > t.finished_at + self.claim_grace_s
            if t.state is TransferState.COMPLETE:
                free = t.released or grace_over
            else:
                free = t.released or not t.delivered_any or grace_over
            if not free:
                return
            if not t.released and (t.state is TransferState.COMPLETE or t.delivered_any):
                self._unclaimed_freed += 1  # the consumer never said it was done
            buffer, t.buffer = t.buffer, None
            t.state = t.state.to(TransferState.RELEASED)
            if self._transfers.get(t.request_id) is t:
                del self._transfers[t.request_id]
                self._ended.remember(t.request_id, Ended.of(t.reason, t.attempt))
        self.pool.free(buffer)


_RECEIVING = (TransferState.STARTED, TransferState.ENDING)


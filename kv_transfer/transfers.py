"""`Transfers`: the receive table's transfers and the steps every entry point shares.

It holds the live transfers by request id, the tombstones of recently ended
ones, and the counters behind `ReceiverStats` (`ReceiveCounts`), all guarded
by the table's lock (passed in: `ReceiveTable` owns it). Its steps move a
transfer on and tell the outside: deliver its ready layers in order (then
the verdict), fail it, restart it after a dropped attempt, free its buffer.
They take the lock only for the state change and call the listener and the
peers outside it, under the transfer's `deliver_lock`. See receive_table.py
for the state machine and the locking rules.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kv_transfer.attempts import Peer
from kv_transfer.base import KVReceiveListener, ReceiverStats, TransferOutcome
from kv_transfer.errors import Reason, TransferRefused, make_reason, reason_code
from kv_transfer.incoming import Incoming
from kv_transfer.landing import LandingBufferPool
from kv_transfer.tombstones import Tombstone, Tombstones, ended_refusal

# one logger for the whole receive table (transfers.py is its inner half)
log = logging.getLogger("kv_transfer.receive_table")


@dataclass(slots=True)
class ReceiveCounts:
    """The receiver's counters; mutated under the table's lock."""

    completed: int = 0
    bytes_received: int = 0
    unclaimed_freed: int = 0
    senders_lost: int = 0
    stale_frames: int = 0
    failures: Counter[str] = field(default_factory=Counter)

    def snapshot(self, pool: LandingBufferPool, active_transfers: int) -> ReceiverStats:
        return ReceiverStats(
            bytes_in_use=pool.bytes_in_use,
            capacity_bytes=pool.capacity_bytes,
            active_transfers=active_transfers,
            completed=self.completed,
            bytes_received=self.bytes_received,
            failures=dict(self.failures),
            unclaimed_freed=self.unclaimed_freed,
            senders_lost=self.senders_lost,
            stale_frames=self.stale_frames,
        )


class Transfers:
    def __init__(self, lock: threading.Lock, listener: KVReceiveListener,
                 pool: LandingBufferPool, claim_grace_s: float,
                 ended_kept: int) -> None:  # fmt: skip
        self._lock = lock  # the table's: guards everything here and every Incoming
        self._listener = listener
        self._pool = pool
        self._claim_grace_s = claim_grace_s
        self._live: dict[str, Incoming] = {}
        # recently freed transfers: frames still in flight on other streams are
        # refused as "ended", not counted again
        self._tombstones = Tombstones(ended_kept)
        self.counts = ReceiveCounts()

    # ------------------------------------------------ lookups (caller holds the lock)

    def __len__(self) -> int:
        return len(self._live)

    def get(self, request_id: str) -> Incoming | None:
        return self._live.get(request_id)

    def tombstone(self, request_id: str) -> Tombstone | None:
        return self._tombstones.get(request_id)

    def add(self, t: Incoming) -> None:
        self._live[t.request_id] = t

    def live(self) -> list[Incoming]:
        """A snapshot of the live transfers, to walk outside the lock."""
        return list(self._live.values())

    def authenticated(self, request_id: str, peer: Peer) -> Incoming:
        """The transfer, if `peer` sent a valid BEGIN for it in the current
        attempt; a dropped attempt's stream is refused (counted)."""
        t = self._live.get(request_id)
        if t is None and request_id in self._tombstones:
            raise self._tombstones.get(request_id).refusal()
        if t is not None and not t.state.terminal and t.attempts.dropped(peer):
            self.counts.stale_frames += 1
            raise TransferRefused(Reason.SUPERSEDED, f"{request_id!r}: this stream's attempt "
                                  "was dropped")  # fmt: skip
        if t is None or not t.attempts.carries(peer):
            raise TransferRefused(Reason.UNKNOWN_REQUEST, f"no BEGIN for {request_id!r} here")
        if t.state.terminal:
            raise ended_refusal(t.reason)
        return t

    # ------------------------------------------------ steps (caller does not hold the lock)

    def refuse(self, t: Incoming | None, refused: TransferRefused, request_id: str) -> None:
        """A refused frame fails its transfer if there is one (counted once, by the
        first failure); for an unknown transfer it is counted once per request id
        (a tombstone turns the other streams' copies into quiet refusals)."""
        if t is not None:
            self.fail(t, refused.reason)
            return
        with self._lock:
            if request_id not in self._tombstones:
                self.counts.failures[refused.code.value] += 1
                self._tombstones.remember(request_id, Tombstone(refused.reason))

    def advance(self, t: Incoming) -> None:
        """Deliver every layer that became complete, in order; decide END."""
        with t.deliver_lock:
            while True:
                with self._lock:
                    if t.state.terminal:
                        return
                    layer = t.take_ready_layer()
                    if layer is None:
                        if not t.complete():
                            return
                        self.counts.completed += 1
                        break
                if not self._call(t, "on_layer_ready", t.request_id, layer, t.layer_view(layer)):
                    return
            self._call(t, "on_complete", t.request_id, t.first_token_id)
        for peer in t.end_peers:  # every sender's END stream gets the verdict
            peer.notify(t.request_id, TransferOutcome.complete())

    def fail(self, t: Incoming, reason: str) -> bool:
        """Move `t` to FAILED (False if it already ended) and tell everybody."""
        with t.deliver_lock:
            with self._lock:
                if not t.fail(reason):
                    return False
                self.counts.failures[reason_code(reason)] += 1
                peers = list(t.attempts.peers)
            log.info("kv transfer %s failed: %s", t.request_id, reason)
            self._call(t, "on_failed", t.request_id, reason)
        for peer in peers:
            peer.notify(t.request_id, TransferOutcome.failed(reason))
        self.free(t)
        return True

    def drop_current(self, t: Incoming, reason: str, epoch: int) -> bool:
        """Drop `t`'s attempt `epoch` (sender lost); False if it is no longer current."""
        with t.deliver_lock:
            with self._lock:
                if not t.runs_attempt(epoch):
                    return False
                stale = t.drop_attempt()
                self.counts.senders_lost += 1
            self.restarted(t, reason, stale)
        return True

    def restarted(self, t: Incoming, reason: str, stale: list[Peer]) -> None:
        """Caller holds t.deliver_lock (not the table's lock): tell the consumer,
        then the dropped attempt's streams (so a sender that is still alive stops)."""
        log.info("kv transfer %s restarts: %s", t.request_id, reason)
        self._call(t, "on_restart", t.request_id, reason)
        outcome = TransferOutcome.failed(make_reason(Reason.SUPERSEDED, reason))
        for peer in stale:
            peer.notify(t.request_id, outcome)

    def free(self, t: Incoming, now: float | None = None) -> None:
        """Return `t`'s buffer to the pool if its time came (`Incoming.take_buffer`);
        `t` then leaves the table, its tombstone stays."""
        now = time.time() if now is None else now
        with self._lock:
            taken = t.take_buffer(now, self._claim_grace_s)
            if taken is None:
                return
            buffer, unclaimed = taken
            if unclaimed:
                self.counts.unclaimed_freed += 1
            if self._live.get(t.request_id) is t:
                del self._live[t.request_id]
                self._tombstones.remember(t.request_id, t.tombstone())
        self._pool.free(buffer)

    def _call(self, t: Incoming, hook: str, *args: object) -> bool:
        """Run a listener hook; a raising listener fails the transfer (not the thread)."""
        try:
            getattr(self._listener, hook)(*args)
            return True
        except Exception:
            log.exception("kv listener %s raised for %s", hook, t.request_id)
            if hook != "on_failed":
                self.fail(t, make_reason(Reason.CANCELLED, f"listener {hook} raised"))
            return False

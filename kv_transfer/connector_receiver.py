"""`ConnectorReceiver`: what every connector's receiver shares.

A connector's receiver is a landing-buffer pool, a `ReceiveTable` (the
per-transfer state machine both connectors drive) and a sweeper thread
sweeping that table; the connectors differ only in how frames reach the
table (TCP sockets, gRPC `Push` streams). This base builds the shared parts
and implements the `KVReceiver` methods that merely delegate to the table;
subclasses implement `start()` (binding `_endpoints`, then starting
`sweeper`) and `close()` (stopping `sweeper`, then closing the table).
"""

from __future__ import annotations

import dataclasses

from kv_transfer.base import (
    KVLayout,
    KVReceiveListener,
    KVReceiver,
    ReceiverStats,
    TransferTarget,
)
from kv_transfer.config import ReceiverConfig
from kv_transfer.landing import LandingBufferPool
from kv_transfer.receive_table import ReceiveTable
from kv_transfer.refusals import RefusalCounts
from kv_transfer.sweeper import Sweeper
from kv_transfer.tickets import TicketAuthority


class ConnectorReceiver(KVReceiver):
    """`expect`/`release`/`cancel`/`stats` may be called from any thread."""

    def __init__(self, config: ReceiverConfig, listener: KVReceiveListener,
                 transport: str) -> None:  # fmt: skip
        self.config = config
        self.pool = LandingBufferPool(config.capacity_bytes, config.pin_memory,
                                      config.prefault_landing)  # fmt: skip
        self.table = ReceiveTable(
            self.pool, TicketAuthority(config.secret, config.generation), listener,
            transport=transport, claim_grace_s=config.claim_grace_s,
        )  # fmt: skip
        # Set by the subclass once it is reachable; `expect` refuses before.
        self._endpoints: tuple[str, ...] = ()
        self.sweeper = Sweeper(self.table.sweep, config.sweep_interval_s,
                               f"kv-{transport}-gc")  # fmt: skip
        # What the port refused, by reason; the subclass's I/O threads add to it.
        self.refusals = RefusalCounts()

    @property
    def generation(self) -> int:
        return self.table.authority.generation

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._endpoints

    def expect(self, request_id: str, layout: KVLayout, deadline: float,
               transfer_timeout_s: float | None = None) -> TransferTarget:
        if not self._endpoints:
            raise RuntimeError(f"{type(self).__name__}.expect called before it was started")
        return self.table.expect(request_id, layout, deadline, self._endpoints,
                                 transfer_timeout_s)

    def release(self, request_id: str) -> bool:
        return self.table.release(request_id)

    def cancel(self, request_id: str, reason: str) -> bool:
        return self.table.cancel(request_id, reason)

    def stats(self) -> ReceiverStats:
        return dataclasses.replace(self.table.stats(), refusals=self.refusals.snapshot(),
                                   open_connections=self.open_connections(),
                                   pending_connections=self.pending_connections())

    def open_connections(self) -> int:
        """Sender connections open now; 0 unless the subclass owns its connections."""
        return 0

    def pending_connections(self) -> int:
        """Connections waiting to authenticate; 0 unless the subclass has a lobby."""
        return 0

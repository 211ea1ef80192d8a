"""Per-transfer receiver state: the `Peer` protocol, `Incoming` (one transfer's
mutable bookkeeping) and `WriteClaim` (one DATA frame's permission to write).

Only `ReceiveTable` (receive_table.py) creates and mutates these, under its
lock; see its docstring for the state machine and the locking rules.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from kv_transfer.base import KVLayout, TransferOutcome, TransferState
from kv_transfer.device import byte_view
from kv_transfer.landing import LandingBuffer


class Peer(Protocol):
    """A sender-facing stream (TCP connection, gRPC call): the back channel."""

    def notify(self, request_id: str, outcome: TransferOutcome) -> None:
        """Tell the sender this transfer's outcome; must not block for long."""


class Incoming:
    """Mutable state of one transfer; fields guarded by ReceiveTable._lock."""

    __slots__ = (
        "request_id", "layout", "deadline", "buffer", "bytes", "state", "reason", "rows",
        "layer_rows", "next_layer", "writers", "delivered_any", "released", "peers",
        "end_peer", "first_token_id", "end_total", "finished_at", "deliver_lock",
        "attempt", "epoch", "retired", "stale_peers", "inflight",
    )  # fmt: skip

    def __init__(self, request_id: str, layout: KVLayout, deadline: float,
                 buffer: LandingBuffer) -> None:  # fmt: skip
        self.request_id = request_id
        self.layout = layout
        self.deadline = deadline
        self.buffer: LandingBuffer | None = buffer
        self.bytes = byte_view(buffer.data)
        self.state = TransferState.EXPECTED
        self.reason = ""
        self.rows = bytearray(layout.num_layers * layout.rows_per_layer)  # 1 = claimed
        self.layer_rows = [0] * layout.num_layers  # committed rows per layer
        self.next_layer = 0  # next layer to deliver
        self.writers = 0
        self.delivered_any = False
        self.released = False
        self.peers: list[Peer] = []
        self.end_peer: Peer | None = None
        self.first_token_id = 0
        self.end_total = 0
        self.finished_at = 0.0
        self.deliver_lock = threading.RLock()
        self.attempt = b""  # the current attempt's id (from its BEGIN)
        self.epoch = 0  # bumped per dropped attempt: a claim's epoch tells stale commits
        self.retired: set[bytes] = set()  # ids of dropped attempts: their BEGINs are stale
        self.stale_peers: list[Peer] = []  # streams of dropped attempts
        self.inflight: dict[int, WriteClaim] = {}  # id(claim) -> claim being written

    def reset_progress(self) -> None:
        """Caller holds ReceiveTable._lock. Drop the current attempt's rows; rows a
        dropped writer is still writing stay busy (2) until its commit."""
        self.epoch += 1
        self.rows = bytearray(len(self.rows))
        for c in self.inflight.values():
            self.rows[c.first : c.first + c.num_rows] = b"\x02" * c.num_rows
        self.layer_rows = [0] * self.layout.num_layers
        self.next_layer = 0
        self.end_peer = None
        self.end_total = 0

    def layer_view(self, layer: int) -> torch.Tensor:
        assert self.buffer is not None
        bpl = self.layout.bytes_per_layer
        flat = self.buffer.data[layer * bpl : (layer + 1) * bpl]
        return flat.view(self.layout.torch_dtype).view(self.layout.layer_shape)


@dataclass(frozen=True, slots=True)
class WriteClaim:
    """Permission to write `view` (the landing bytes of one DATA frame). The
    transport writes the payload into `view`, then calls `ReceiveTable.commit`."""

    request_id: str
    layer: int
    num_rows: int
    view: memoryview
    _transfer: Incoming
    first: int = 0  # first row index (layer * rows_per_layer + row)
    epoch: int = 0  # the attempt it was granted to

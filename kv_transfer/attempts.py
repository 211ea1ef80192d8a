"""Sending attempts of one transfer: which sender streams are current, which stale.

A transfer outlives its sender. Every BEGIN carries the sender's attempt id
(the same on all streams of one attempt, a new one for a retry). Streams that
sent a BEGIN of the current attempt are its `peers` (the `Peer` protocol: a
TCP connection, a gRPC call). When the attempt is dropped (its sender is lost,
or a new attempt supersedes it) its id is retired, its peers become stale
(their frames are refused as `superseded`), and `epoch` moves on, so a write
the dropped attempt still has in flight is recognised as stale at its commit.

Not thread-safe: the receive table calls it under its own lock.
"""

from __future__ import annotations

from typing import Protocol

from kv_transfer.base import TransferOutcome


class Peer(Protocol):
    """A sender-facing stream (TCP connection, gRPC call): the back channel."""

    def notify(self, request_id: str, outcome: TransferOutcome) -> None:
        """Tell the sender this transfer's outcome; must not block for long."""


class Attempts:
    """The current attempt of one transfer, and what is left of dropped ones."""

    __slots__ = ("current", "epoch", "retired", "peers", "stale_peers")

    def __init__(self) -> None:
        self.current = b""  # the current attempt's id (from its BEGIN)
        self.epoch = 0  # bumped per dropped attempt: a claim's epoch tells stale commits
        self.retired: set[bytes] = set()  # ids of dropped attempts: their BEGINs are stale
        self.peers: list[Peer] = []  # streams that sent a BEGIN of the current attempt
        self.stale_peers: list[Peer] = []  # streams of dropped attempts

    def carries(self, peer: Peer) -> bool:
        """`peer` sent a BEGIN of the current attempt."""
        return any(p is peer for p in self.peers)

    def dropped(self, peer: Peer) -> bool:
        """`peer` belongs to a dropped attempt (and sent no later BEGIN)."""
        return any(p is peer for p in self.stale_peers)

    def is_retired(self, attempt: bytes) -> bool:
        return attempt in self.retired

    def start(self, attempt: bytes) -> None:
        """`attempt` becomes the current one (the transfer had none running)."""
        self.current = attempt

    def join(self, peer: Peer) -> None:
        """`peer` sent a BEGIN of the current attempt."""
        # a persistent connection may carry a later attempt after a dropped one:
        # frames are ordered on it, so everything after this BEGIN is current
        self.stale_peers = [p for p in self.stale_peers if p is not peer]
        if not self.carries(peer):
            self.peers.append(peer)

    def drop(self) -> list[Peer]:
        """Drop the current attempt: its id is retired, its streams become stale
        (returned, to be told), and the epoch moves on."""
        self.retired.add(self.current)
        stale, self.peers = self.peers, []
        self.stale_peers.extend(stale)
        self.epoch += 1
        return stale

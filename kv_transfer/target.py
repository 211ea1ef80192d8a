"""`TransferTarget`: where and how a prefill pod sends one request's KV.

A decode pod at TP=1 has one KV receiver: the target's `endpoints`. A decode
pod at TP=b > 1 has one receiver per rank (each lands and injects only its
own KV heads): the target lists them in `ranks`, one `RankTarget` per rank
in rank order, and `endpoints` is rank 0's, so a pod that knows nothing of
ranks still reads a valid TP=1 target. One ticket serves every rank: the
ranks share the ticket secret and generation, and each issues the same bytes
for the same request and deadline (kv_transfer/tickets.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kv_transfer.layout import MAX_KV_HEADS, check_int
from proto.address import split_host_port

MAX_TICKET_BYTES = 512
TRANSPORTS = ("tcp", "grpc")
MAX_TENSOR_PARALLEL = 64


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' -> (host, port) for a socket (an IPv6 literal loses its
    brackets); raises ValueError naming the bad endpoint."""
    host, port = split_host_port(endpoint, "endpoint")
    return host.strip("[]"), port


def _check_endpoints(endpoints: tuple[str, ...], what: str) -> None:
    if not isinstance(endpoints, tuple) or not endpoints:
        raise ValueError(f"{what} must be a non-empty tuple, got {endpoints!r}")
    for endpoint in endpoints:
        split_endpoint(endpoint)


@dataclass(frozen=True, slots=True)
class RankTarget:
    """One decode rank's KV receiver and the global KV heads [head_start,
    head_end) it holds (and so receives)."""

    endpoints: tuple[str, ...]
    head_start: int
    head_end: int

    def __post_init__(self) -> None:
        _check_endpoints(self.endpoints, "a rank's endpoints")
        check_int("head_start", self.head_start, 0, MAX_KV_HEADS - 1)
        check_int("head_end", self.head_end, self.head_start + 1, MAX_KV_HEADS)


@dataclass(frozen=True, slots=True)
class TransferTarget:
    """Where and how a prefill pod sends one request's KV; issued by `KVReceiver.expect`.

    `deadline` is unix seconds: after it the receiver fails the transfer and
    frees its landing buffer, whatever state it is in (a receiver given a
    transfer timeout may fail a started attempt earlier, `KVReceiver.expect`).

    `ranks` (empty for a TP=1 decode pod) has one entry per decode rank, in
    rank order, `tensor_parallel_size` of them; `endpoints` is then rank 0's.
    """

    endpoints: tuple[str, ...]
    ticket: bytes
    transport: str
    generation: int
    deadline: float
    ranks: tuple[RankTarget, ...] = ()
    tensor_parallel_size: int = 1
    # the request's W3C traceparent, sent in BEGIN (FLAG_TRACE) so the decode
    # pod's spans join its trace; "" = not traced (docs/tracing.md). Set by the
    # prefill pod, never sent back in a Reserved.
    traceparent: str = ""

    def __post_init__(self) -> None:
        _check_endpoints(self.endpoints, "endpoints")
        if not isinstance(self.ticket, bytes) or not 0 < len(self.ticket) <= MAX_TICKET_BYTES:
            raise ValueError(f"ticket must be 1..{MAX_TICKET_BYTES} bytes")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        check_int("generation", self.generation, 0, (1 << 63) - 1)
        if not isinstance(self.deadline, (int, float)) or not math.isfinite(self.deadline):
            raise ValueError(f"deadline must be finite unix seconds, got {self.deadline!r}")
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, MAX_TENSOR_PARALLEL)
        if not isinstance(self.ranks, tuple) or any(
                not isinstance(r, RankTarget) for r in self.ranks):  # fmt: skip
            raise ValueError(f"ranks must be a tuple of RankTarget, got {self.ranks!r}")
        if self.ranks and len(self.ranks) != self.tensor_parallel_size:
            raise ValueError(f"{len(self.ranks)} ranks for tensor_parallel_size "
                             f"{self.tensor_parallel_size}: give one per rank, or none")
        if not self.ranks and self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} without ranks")
        if self.ranks and self.ranks[0].endpoints != self.endpoints:
            raise ValueError(f"endpoints {self.endpoints} are not rank 0's "
                             f"{self.ranks[0].endpoints}")

    @property
    def num_ranks(self) -> int:
        """Decode ranks receiving: len(ranks), 1 for a TP=1 pod."""
        return len(self.ranks) or 1

    def for_rank(self, rank: int) -> TransferTarget:
        """The TP=1-shaped target of decode rank `rank` (its endpoints, the shared
        ticket, the request's traceparent: every rank's BEGIN carries it, so each
        decode rank's receive joins the trace): what a sender's `begin` takes for
        that rank's SubTransfers."""
        if not self.ranks:
            if rank != 0:
                raise ValueError(f"decode rank {rank} of a TP=1 target")
            return self
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"decode rank {rank} outside [0, {len(self.ranks)})")
        return TransferTarget(self.ranks[rank].endpoints, self.ticket, self.transport,
                              self.generation, self.deadline,
                              traceparent=self.traceparent)  # fmt: skip

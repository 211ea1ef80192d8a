"""A prefill rank's KV senders: one per transport, and, when one request
goes to several decode ranks from this rank, one such set per decode rank
it reaches.

A `KVSender` keys its transfers by request id, and each decode rank's
receiver knows the request by that same id; so the i-th transfer of one
request (`rank_sends(...)[i]`) goes through sender set i. Set 0 is the one
a TP=1 pod has always had; more are made on first need (a prefill rank
sends one request to at most b decode ranks) and kept, with their
persistent connections, for the pod's life.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kv_transfer.base import KVSender
from kv_transfer.config import SenderConfig
from kv_transfer.tcp import TcpKVSender
from proto.tls import PodSecurity

log = logging.getLogger(__name__)

SenderFactory = Callable[[], dict[str, KVSender]]


def make_senders(kv_streams: int, security: PodSecurity | None = None) -> dict[str, KVSender]:
    """One sender per transport this build has; the target picks per request.
    `security` secures both transports: the gRPC channels, and the TCP
    streams unless its TLS files say kv_streams=False (`--no-kv-tls`)."""
    config = SenderConfig(num_streams=kv_streams, security=security or PodSecurity())
    senders: dict[str, KVSender] = {"tcp": TcpKVSender(config)}
    try:
        from kv_transfer.grpc import GrpcKVSender
    except ImportError:  # the gRPC connector is optional
        log.info("gRPC KV sender not available; serving tcp targets only")
    else:
        senders["grpc"] = GrpcKVSender(config)
    return senders


class SenderSets:
    """Sender set 0 (given) and the sets made by `make` as needed.
    Thread-safe; `close` closes every sender of every set."""

    def __init__(self, first: dict[str, KVSender], make: SenderFactory | None = None) -> None:
        if not first:
            raise ValueError("a prefill rank needs at least one KV sender")
        self._sets = [dict(first)]
        self._make = make
        self._lock = threading.Lock()

    @property
    def transports(self) -> tuple[str, ...]:
        return tuple(self._sets[0])

    def get(self, index: int, transport: str) -> KVSender:
        """The sender of set `index` for `transport`; ValueError for a
        transport this pod has no sender for, or a set beyond the first on
        a pod built without a factory."""
        if transport not in self._sets[0]:
            raise ValueError(f"target transport {transport!r} is not available on this "
                             f"prefill pod (available: {', '.join(self._sets[0])})")
        with self._lock:
            while len(self._sets) <= index:
                if self._make is None:
                    raise ValueError(f"this prefill rank has one sender per transport; a "
                                     f"request sent to {index + 1} decode ranks from it needs "
                                     f"one set per decode rank")
                self._sets.append(self._make())
            return self._sets[index][transport]

    def close(self) -> None:
        with self._lock:
            sets, self._sets = self._sets, self._sets[:1]
        for senders in sets:
            for sender in senders.values():
                sender.close()

"""Validated configuration of senders and receivers (one dataclass each; the pods'
command modules fill them from flags, kv_transfer never sees argparse)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.checksum import CHECKSUMS
from kv_transfer.wire import MAX_DATA_BYTES
from proto.tls import PodSecurity


def _positive(name: str, value: float, high: float) -> None:
    if not isinstance(value, (int, float)) or not 0 < value <= high:
        raise ValueError(f"{name} must be in (0, {high}], got {value!r}")


@dataclass(frozen=True, slots=True)
class SenderConfig:
    """num_streams: parallel connections (TCP) or calls (gRPC) per transfer.
    max_chunk_bytes: largest DATA payload; layers are sliced row-aligned below it.
    min_chunk_bytes: smallest DATA payload a layer is cut into (unless the layer,
    or max_chunk_bytes, is smaller): below ~2 MiB per-frame work dominates
    (benchmarks/results/history/kv_transfer.md), so with many streams a layer
    takes fewer of them and the next layer the next ones.
    checksum: of DATA payloads, "xxh3" (XXH3-64, default: ~3x cheaper than XXH64,
    which at wire speed on few cores is the difference between ~60% and ~75% of
    the raw-socket ceiling, docs/benchmarks.md) or "xxh64". Both connectors flag
    it per DATA frame and every receiver checks either; control frames always
    use xxh64."""

    num_streams: int = 4
    max_chunk_bytes: int = 4 << 20
    min_chunk_bytes: int = 2 << 20
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 30.0
    verdict_grace_s: float = 2.0  # after the target's deadline, before giving up locally
    sweep_interval_s: float = 0.2
    checksum: str = "xxh3"
    # TLS + token of the gRPC connector's channels (the pods' own); the TCP
    # connector's streams use its TLS files too unless they say kv_streams=False
    # (KV TLS, kv_transfer/tcp/tls.py; the token is gRPC's only)
    security: PodSecurity = field(default_factory=PodSecurity)

    def __post_init__(self) -> None:
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"checksum must be one of {CHECKSUMS}, got {self.checksum!r}")
        if not isinstance(self.num_streams, int) or not 1 <= self.num_streams <= 64:
            raise ValueError(f"num_streams must be an int in [1, 64], got {self.num_streams!r}")
        if not isinstance(self.max_chunk_bytes, int) or not (
            4096 <= self.max_chunk_bytes <= MAX_DATA_BYTES
        ):
            raise ValueError(
                f"max_chunk_bytes must be in [4096, {MAX_DATA_BYTES}], got {self.max_chunk_bytes}"
            )
        if not isinstance(self.min_chunk_bytes, int) or not (
            0 <= self.min_chunk_bytes <= MAX_DATA_BYTES
        ):
            raise ValueError(
                f"min_chunk_bytes must be in [0, {MAX_DATA_BYTES}], got {self.min_chunk_bytes}"
            )
        _positive("connect_timeout_s", self.connect_timeout_s, 600)
        _positive("io_timeout_s", self.io_timeout_s, 3600)
        _positive("verdict_grace_s", self.verdict_grace_s, 600)
        _positive("sweep_interval_s", self.sweep_interval_s, 60)


@dataclass(frozen=True, slots=True)
class ReceiverConfig:
    """capacity_bytes: landing pool budget. claim_grace_s: how long a finished
    transfer's buffer waits for `release` before the collector frees it.
    secret: shared HMAC secret (None: random per receiver). generation: this
    incarnation (None: random).
    io_timeout_s: once a frame's first byte has arrived, the whole frame
    (header and payload, up to 64 MiB) must arrive within this; a peer that
    trickles bytes is cut off (TCP; it also bounds each send).
    max_connections: authenticated sender connections the TCP port serves at
    once (each is a thread); more are closed at once, and counted. A prefill
    pod keeps `num_streams` (4) connections to each decode pod it sends to.
    auth_timeout_s, max_pending, max_pending_per_peer: connections that have
    not yet sent a BEGIN with a valid ticket (no thread, no slot; lobby.py)."""

    capacity_bytes: int
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None  # what senders dial; defaults to host
    claim_grace_s: float = 30.0
    sweep_interval_s: float = 0.2
    io_timeout_s: float = 10.0
    max_connections: int = 256
    # before a TCP connection authenticates (kv_transfer/tcp/lobby.py): its first
    # frame, a BEGIN with a valid ticket, within this; at most this many waiting,
    # and this many from one address
    auth_timeout_s: float = 5.0
    max_pending: int = 256
    max_pending_per_peer: int = 64
    secret: bytes | None = None
    generation: int | None = None
    pin_memory: bool | None = None
    prefault_landing: bool = False  # touch the whole landing slab at start (see landing.py)
    # TLS + token of the gRPC connector's own port; the TCP port serves TLS
    # with the same files unless they say kv_streams=False (KV TLS,
    # kv_transfer/tcp/tls.py; the token is gRPC's only)
    security: PodSecurity = field(default_factory=PodSecurity)

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {self.capacity_bytes!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if not self.host:
            raise ValueError("host must be non-empty")
        _positive("claim_grace_s", self.claim_grace_s, 3600)
        _positive("sweep_interval_s", self.sweep_interval_s, 60)
        _positive("io_timeout_s", self.io_timeout_s, 3600)
        _positive("auth_timeout_s", self.auth_timeout_s, 3600)
        for name in ("max_pending", "max_pending_per_peer"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 65536:
                raise ValueError(f"{name} must be an int in [1, 65536], got {value!r}")
        if not isinstance(self.max_connections, int) or not 1 <= self.max_connections <= 65536:
            raise ValueError(f"max_connections must be an int in [1, 65536], "
                             f"got {self.max_connections!r}")

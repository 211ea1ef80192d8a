"""Validated configurations of the decode pod (`DecodeConfig`) and the
colocated pod (`ColocatedConfig`), built by `pdserve decode` / `pdserve
serve` from their flags; the services never see argparse."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from pod.config import ServerConfig

KV_TRANSPORTS = ("tcp", "grpc")
MAX_TRANSFER_TIMEOUT_S = 3600.0
MAX_RESERVATION_TIMEOUT_S = 86400.0


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """A decode pod: engine, gRPC server, and the KV receiver.

    `kv_port` is where prefill pods push KV (the TCP listener, or the gRPC
    `KVTransfer` server; at tensor_parallel_size b rank r's is kv_port + r);
    `landing_memory` bounds the bytes of KV in flight
    (a full pool refuses new requests with RESOURCE_EXHAUSTED);
    `transfer_timeout_s` is how long one sending attempt may take from its
    BEGIN to the last layer, and `reservation_timeout_s` how long a reserved
    request waits for a prefill pod to begin sending (its prefill may be
    queued there); past either it fails with DEADLINE_EXCEEDED and its
    blocks are freed. `join_wait` is the fraction of a step the engine may
    hold a step's start for a transfer about to complete (engine/engine_loop.py,
    "Joining a running batch"; 0 = never).
    """

    engine: EngineConfig
    server: ServerConfig
    kv_port: int = 50062
    kv_transport: str = "tcp"
    landing_memory: int = 1 << 30
    transfer_timeout_s: float = 30.0
    reservation_timeout_s: float = 600.0
    kv_max_connections: int = 256
    kv_frame_timeout_s: float = 10.0
    # TCP KV connections before they authenticate (kv_transfer/tcp/lobby.py)
    kv_auth_timeout_s: float = 5.0
    kv_max_pending: int = 256
    kv_max_pending_per_peer: int = 64
    join_wait: float = 0.5

    def __post_init__(self) -> None:
        # At TP=b rank r listens on kv_port + r (docs/tensor_parallel.md, Decode ranks).
        last = 65535 - self.engine.tensor_parallel_size + 1
        if not 0 <= self.kv_port <= last:
            raise ValueError(f"kv_port must be in [0, {last}] (0 = any free port), got "
                             f"{self.kv_port}: rank r of the pod's "
                             f"{self.engine.tensor_parallel_size} listens on kv_port + r")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, "
                             f"got {self.kv_transport!r}")
        if self.landing_memory <= 0:
            raise ValueError(f"landing_memory must be > 0 bytes, got {self.landing_memory}")
        if not 0 < self.transfer_timeout_s <= MAX_TRANSFER_TIMEOUT_S:
            raise ValueError(f"transfer_timeout must be in (0, {MAX_TRANSFER_TIMEOUT_S}] "
                             f"seconds, got {self.transfer_timeout_s}")
        if not 0 < self.reservation_timeout_s <= MAX_RESERVATION_TIMEOUT_S:
            raise ValueError(f"reservation_timeout must be in (0, {MAX_RESERVATION_TIMEOUT_S}] "
                             f"seconds, got {self.reservation_timeout_s}")
        if not 1 <= self.kv_max_connections <= 65536:
            raise ValueError(f"kv_max_connections must be in [1, 65536], "
                             f"got {self.kv_max_connections}")
        if not 0 < self.kv_frame_timeout_s <= 3600:
            raise ValueError(f"kv_frame_timeout must be in (0, 3600] seconds, "
                             f"got {self.kv_frame_timeout_s}")
        if not 0 <= self.join_wait <= 1:
            raise ValueError(f"join_wait must be in [0, 1] of a step, got {self.join_wait}")


@dataclass(frozen=True, slots=True)
class ColocatedConfig:
    """A colocated pod: prefill and decode in one engine, no KV transfer."""

    engine: EngineConfig
    server: ServerConfig

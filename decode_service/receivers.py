"""The KV receiver of a decode pod's rank: its `ReceiverConfig` from the
pod's config, and the receiver of the pod's transport. Rank 0 builds its
own (decode_service/server.py); at TP > 1 it sends each worker rank its
config (decode_service/rank_wire.py, SETUP), so every rank listens with the
same transport, security, ticket secret and generation."""

from __future__ import annotations

import logging

from decode_service.config import DecodeConfig
from kv_transfer.base import KVReceiveListener, KVReceiver
from kv_transfer.config import ReceiverConfig

log = logging.getLogger(__name__)


def receiver_config(config: DecodeConfig, rank: int = 0, *, secret: bytes | None = None,
                    generation: int | None = None) -> ReceiverConfig:
    """Rank `rank`'s receiver: on --kv-port + rank (0: any free port), the
    pod's advertised host, and (TP > 1) the pod's ticket secret and generation."""
    return ReceiverConfig(
        capacity_bytes=config.landing_memory, host=config.server.host,
        port=config.kv_port + rank if config.kv_port else 0,
        advertise_host=config.server.public_host(), security=config.server.security,
        max_connections=config.kv_max_connections, io_timeout_s=config.kv_frame_timeout_s,
        auth_timeout_s=config.kv_auth_timeout_s, max_pending=config.kv_max_pending,
        max_pending_per_peer=config.kv_max_pending_per_peer,
        secret=secret, generation=generation)


def open_receiver(transport: str, config: ReceiverConfig,
                  listener: KVReceiveListener) -> KVReceiver:
    """The receiver for `transport` ("tcp" or "grpc"), not started yet."""
    if transport == "tcp":
        from kv_transfer.tcp import TcpKVReceiver
        from kv_transfer.tcp.tls import kv_tls_files

        if config.security.enabled and kv_tls_files(config.security) is None:
            # --no-kv-tls beside pod TLS (docs/kv_transfer.md, "TLS on the TCP KV
            # streams"): tickets and the chart's NetworkPolicy still guard the port
            log.info("KV transport tcp: plaintext on the cluster network (--no-kv-tls; "
                     "only prefill pods may reach it)")
        return TcpKVReceiver(config, listener)
    from kv_transfer.grpc import GrpcKVReceiver

    return GrpcKVReceiver(config, listener)

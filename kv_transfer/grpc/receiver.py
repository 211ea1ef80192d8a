"""gRPC receiver: the table + sweeper behind a `KVTransfer` servicer.

Two ways to host it: `start()` runs its own `grpc.server` on `config.port`
(the kv port; `serve(config, listener)` does that in one call), or
`add_to_server(server, endpoint)` puts the servicer on a server the decode pod
already runs (create it with `SERVER_OPTIONS` and enough threads) and
`start()` then only starts the sweeper.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc

from kv_transfer.base import (
    KVReceiveListener,
    split_endpoint,
)
from kv_transfer.config import ReceiverConfig
from kv_transfer.connector_receiver import ConnectorReceiver
from kv_transfer.grpc.servicer import SERVER_OPTIONS, KVTransferServicer
from proto.tls import add_port, server_interceptors

DEFAULT_SERVER_THREADS = 64  # one per open stream: N streams x transfers in flight


class GrpcKVReceiver(ConnectorReceiver):
    def __init__(self, config: ReceiverConfig, listener: KVReceiveListener,
                 server_threads: int = DEFAULT_SERVER_THREADS) -> None:  # fmt: skip
        if not 1 <= server_threads <= 4096:
            raise ValueError(f"server_threads must be in [1, 4096], got {server_threads}")
        super().__init__(config, listener, transport="grpc")
        self.servicer = KVTransferServicer(self.table)
        self._server_threads = server_threads
        self._server: grpc.Server | None = None

    def add_to_server(self, server: grpc.Server, endpoint: str) -> None:
        """Host the servicer on an existing server reachable at `endpoint` ('host:port')."""
        split_endpoint(endpoint)
        self.servicer.add_to_server(server)
        self._endpoints = (endpoint,)

    def start(self) -> None:
        if not self._endpoints:
            security = self.config.security  # the pod's TLS and token (proto/tls.py)
            server = grpc.server(ThreadPoolExecutor(self._server_threads,
                                                    thread_name_prefix="kv-grpc"),
                                 options=SERVER_OPTIONS,
                                 interceptors=server_interceptors(security, aio=False))
            self.servicer.add_to_server(server)
            try:
                port = add_port(server, f"{self.config.host}:{self.config.port}", security.tls)
            except ValueError as exc:
                raise OSError(str(exc)) from None
            server.start()
            self._server = server
            self._endpoints = (f"{self.config.advertise_host or self.config.host}:{port}",)
        self.sweeper.start()

    def close(self) -> None:
        self.sweeper.stop()
        if self._server is not None:
            self._server.stop(grace=0).wait(10)
        self.table.close()


def serve(config: ReceiverConfig, listener: KVReceiveListener) -> GrpcKVReceiver:
    """A started standalone receiver on `config.port` (0: any free port)."""
    receiver = GrpcKVReceiver(config, listener)
    receiver.start()
    return receiver

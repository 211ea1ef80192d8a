"""`PodChannels`: one reused gRPC channel (and stubs) per pod address, and
this router process's one Decode.Session stream per decode/colocated pod
(`DecodeStream`, router/decode_stream.py).

Owned by the router server, used by every request's flow on the router's
event loop. Channels are opened lazily on first use and live until
`close()`; gRPC reconnects a channel by itself after its pod restarts, so an
address never needs a second one. Message size limits are the project's
(proto/limits.py): a long prompt's token list can exceed gRPC's 4 MiB default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from proto.limits import GRPC_MESSAGE_OPTIONS, GRPC_RECONNECT_OPTIONS
from proto.tls import PodSecurity, pod_channel
from router.decode_stream import DecodeStream

log = logging.getLogger(__name__)

_OPTIONS = [
    *GRPC_MESSAGE_OPTIONS,
    # Notice a dead pod within seconds even while a stream is idle.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # ... but only while a call is open. The pods' servers keep gRPC's default
    # ping policy (no pings without calls), so pinging an idle channel earns a
    # strike each time and after the third the pod answers GOAWAY "too many
    # pings", failing every call on the channel (seen after ~30 s idle between
    # benchmark rounds). Idle pods are watched by the GetLoad poller instead.
    ("grpc.keepalive_permit_without_calls", 0),
    # a restarted pod is reached again within a second (proto/limits.py)
    *GRPC_RECONNECT_OPTIONS,
]


class PodChannels:
    """Lazily opened channels and stubs keyed by address."""

    def __init__(self, *, decode_streams: bool = True, security: PodSecurity | None = None,
                 on_relayed: Callable[[int], None] | None = None) -> None:
        """`on_relayed`: given to each DecodeStream (tokens the direct relay wrote)."""
        # False: every request gets its own Decode.Generate (RouterConfig.relay "stream")
        self._use_streams = decode_streams
        self._security = security or PodSecurity()  # TLS + token (proto/tls.py)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prefill: dict[str, pdserve_pb2_grpc.PrefillStub] = {}
        self._decode: dict[str, pdserve_pb2_grpc.DecodeStub] = {}
        self._streams: dict[str, DecodeStream] = {}
        self._no_session: set[str] = set()  # pods that answered Session UNIMPLEMENTED
        self._on_relayed = on_relayed

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = pod_channel(address, self._security, _OPTIONS)
            self._channels[address] = channel
        return channel

    def prefill(self, address: str) -> pdserve_pb2_grpc.PrefillStub:
        stub = self._prefill.get(address)
        if stub is None:
            stub = self._prefill[address] = pdserve_pb2_grpc.PrefillStub(self._channel(address))
        return stub

    def decode(self, address: str) -> pdserve_pb2_grpc.DecodeStub:
        """Decode.Generate serves both decode and colocated pods."""
        stub = self._decode.get(address)
        if stub is None:
            stub = self._decode[address] = pdserve_pb2_grpc.DecodeStub(self._channel(address))
        return stub

    async def open_generate(self, address: str, request: pb.DecodeGenerateRequest,
                            timeout: float):
        """Start `request` on the decode/colocated pod at `address` and read its
        first message. Returns (call, first): `call` has `read()` and
        `cancel()` like a Decode.Generate call. Raises grpc.aio.AioRpcError as
        that call would. The request rides this router's Session stream to
        the pod (router/decode_stream.py); a pod without Session gets
        Decode.Generate."""
        if self._use_streams and address not in self._no_session:
            stream = self._stream(address)
            call = stream.open(request, timeout)
            try:
                return call, await call.read()
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("decode pod %s has no Session; using Decode.Generate", address)
                    self._no_session.add(address)
                elif error.code() == grpc.StatusCode.INTERNAL and not stream.heard_from_pod:
                    # A stream the pod closes at once can surface on the client
                    # as gRPC core's own INTERNAL ("Failed execute_batch")
                    # instead of the pod's status (e.g. UNIMPLEMENTED): with
                    # nothing heard on it, this request takes Generate instead.
                    log.info("session to decode pod %s failed before its first message "
                             "(%s); using Decode.Generate for %s", address, error.details(),
                             request.request_id)
                else:
                    raise
            except BaseException:
                call.cancel()
                raise
        call = self.decode(address).Generate(request, timeout=timeout)
        try:
            return call, await call.read()
        except BaseException:
            call.cancel()
            raise

    def _stream(self, address: str) -> DecodeStream:
        stream = self._streams.get(address)
        if stream is None or stream.closed:
            stream = self._streams[address] = DecodeStream(
                address, self.decode(address), on_relayed=self._on_relayed)
        return stream

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await stream.close()
        channels, self._channels = list(self._channels.values()), {}
        self._prefill.clear()
        self._decode.clear()
        for channel in channels:
            await channel.close(grace=None)

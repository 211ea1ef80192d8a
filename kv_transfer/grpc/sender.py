"""gRPC sender: each transfer runs N concurrent `KVTransfer.Push` calls.

Life of a transfer: `begin` opens N client-streaming calls (call i on channel
i of the pool for endpoint i mod E; channels are separate HTTP/2 connections so
the streams really run in parallel), each fed by its own queue that starts
with BEGIN. `send_layer` stages the chunk and spreads its pieces round-robin
over the queues; gRPC's own threads pull the frames (encoding each message,
codec.py, and its checksum there, not on the engine thread). `end` puts END on
call 0 and ends call 0's stream: the receiver answers call 0 with the verdict
once all streams' bytes are in, and only then do calls 1..N-1 end (a call that
ends while its transfer is open means a lost sender to the receiver). Any
call answering ok=False, or breaking, fails the transfer; `abort` sends ABORT
on call 0.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import torch

from kv_transfer.base import KVLayout, KVSender, TransferOutcome, TransferTarget
from kv_transfer.checksum import FLAG_XXH3, checksum, data_checksum
from kv_transfer.config import SenderConfig
from kv_transfer.device import HostCopy, HostStager, byte_view
from kv_transfer.errors import Reason, make_reason
from kv_transfer.grpc.codec import encode_data_frame, trace_field
from kv_transfer.grpc.servicer import SERVICE
from kv_transfer.outgoing import Outgoing, Piece
from kv_transfer.sweeper import Sweeper
from kv_transfer.wire import FLAG_HEAD_RANGE, FLAG_TRACE, MAX_DATA_BYTES, VERSION
from proto import pdserve_pb2
from proto.request_id import check_request_id
from proto.tls import pod_channel

_KIND = pdserve_pb2.FrameKind
_PUSH = f"/{SERVICE}/Push"
# Resolved transfers kept for the engine's late send_layer/end calls: only a
# transfer that failed while its request was still prefilling sees them, so a
# few hundred cover any pod. An evicted one's late call is refused and its
# export fails, the end it had anyway. Each kept entry holds its future, and a
# future keeps its done-callbacks (and what they captured) alive: 4,096 of
# them cost the prefill pod ~25 MiB of RSS over a soak
# (benchmarks/results/history/soak.md, "Where the prefill pod's memory went").
_FINISHED_KEPT = 256
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_DATA_BYTES + (1 << 20)),
    ("grpc.use_local_subchannel_pool", 1),  # channel i really owns its own connection
]


@dataclass(frozen=True, slots=True)
class _Item:
    kind: int
    payload: bytes = b""
    piece: Piece | None = None
    host: HostCopy | None = None
    first_token_id: int = 0


class _Transfer:
    """An Outgoing plus its calls' queues (guarded by Outgoing.lock for `closed`
    and `released`)."""

    __slots__ = ("out", "queues", "closed", "released")

    def __init__(self, out: Outgoing, num_streams: int) -> None:
        self.out = out
        self.queues: list[queue.SimpleQueue[_Item | None]] = [
            queue.SimpleQueue() for _ in range(num_streams)
        ]
        self.closed = False
        self.released = False

    def stop_sending(self, last: _Item | None = None) -> None:
        """No more frames: optionally `last` (END or ABORT), then end call 0's stream
        (once). Calls 1..N-1 stay open until `release_calls`."""
        with self.out.lock:
            if self.closed:
                return
            self.closed = True
        if last is not None:
            self.queues[0].put(last)
        self.queues[0].put(None)

    def release_calls(self) -> None:
        """End calls 1..N-1 (once), after call 0 finished. The receiver reads a call
        that ends while its transfer is still open as a lost sender (gRPC cannot
        tell a server a cancelled call from a half-closed one), so they end only
        once the verdict is in or the transfer is over for this sender."""
        with self.out.lock:
            if self.released:
                return
            self.released = True
        for q in self.queues[1:]:
            q.put(None)


def _begin_frame(request_id: str, target: TransferTarget, layout: KVLayout,
                 out: Outgoing) -> bytes:  # fmt: skip
    """BEGIN's encoded KVFrame; the head fields (and flags bit 3) only for a
    head-ranged layout, so a TP=1 BEGIN is what earlier senders send."""
    frame = pdserve_pb2.KVFrame(
        version=VERSION, kind=_KIND.FRAME_KIND_BEGIN, request_id=request_id,
        ticket=target.ticket, num_layers=layout.num_layers, num_tokens=layout.num_tokens,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
        payload=out.attempt, checksum=checksum(out.attempt), token_offset=layout.token_offset,
    )  # fmt: skip
    if layout.head_ranged:
        frame.flags = FLAG_HEAD_RANGE
        frame.head_start, frame.model_kv_heads = layout.head_start, layout.model_kv_heads
        frame.sub_start, frame.sub_end = out.part.heads
        frame.num_senders = out.part.num_senders
    if target.traceparent:  # FLAG_TRACE: the decode pod's spans join the trace
        frame.flags |= FLAG_TRACE
        return frame.SerializeToString() + trace_field(target.traceparent)
    return frame.SerializeToString()


class GrpcKVSender(KVSender):
    def __init__(self, config: SenderConfig | None = None) -> None:
        self.config = config or SenderConfig()
        self._stager = HostStager()
        self._lock = threading.Lock()
        self._channels: dict[str, list[grpc.Channel]] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._finished: OrderedDict[str, _Transfer] = OrderedDict()
        self._closed = False
        self._sweeper = Sweeper(self._sweep, self.config.sweep_interval_s, "kv-grpc-send-gc")
        self._sweeper.start()

    def begin(self, request_id: str, target: TransferTarget, layout: KVLayout, *,
              heads: tuple[int, int] | None = None, attempt: bytes | None = None,
              num_senders: int = 1) -> None:  # fmt: skip
        check_request_id(request_id)
        if target.transport != "grpc":
            raise ValueError(f"GrpcKVSender cannot send to a {target.transport!r} target")
        n = self.config.num_streams
        t = _Transfer(Outgoing(request_id, target, layout, heads, attempt, num_senders), n)
        with self._lock:
            if self._closed:
                raise RuntimeError("GrpcKVSender is closed")
            if request_id in self._transfers:
                raise ValueError(f"request {request_id!r} is already being sent")
            self._finished.pop(request_id, None)
            self._transfers[request_id] = t
            channels = self._channels_for(target.endpoints)
        begin = _begin_frame(request_id, target, layout, t.out)
        remaining = target.deadline + self.config.verdict_grace_s - time.time()
        timeout = min(max(0.1, remaining), 86400.0)  # gRPC rejects absurd deadlines
        for i, channel in enumerate(channels):
            # requests are bytes this module encoded (codec.py), so no serializer
            push = channel.stream_unary(_PUSH, request_serializer=None,
                                        response_deserializer=pdserve_pb2.PushResult.FromString)
            call = push.future(self._frames(t, i, begin), timeout=timeout)
            call.add_done_callback(lambda f, i=i: self._call_done(t, i, f))

    def send_layer(self, request_id: str, layer: int, kv: torch.Tensor, token_start: int) -> None:
        t = self._get(request_id)
        n = len(t.queues)
        pieces = t.out.plan(layer, kv, token_start, n, self.config.max_chunk_bytes,
                            self.config.min_chunk_bytes)  # fmt: skip
        if t.out.done or t.closed:
            return
        host = self._stager.stage(t.out.layout.staged(kv))
        with t.out.lock:
            first = t.out.next_stream
            t.out.next_stream = (first + len(pieces)) % n
        for i, piece in enumerate(pieces):
            t.queues[(first + i) % n].put(_Item(_KIND.FRAME_KIND_DATA, piece=piece, host=host))

    def end(self, request_id: str, first_token_id: int) -> Future[TransferOutcome]:
        t = self._get(request_id)
        t.out.request_end(first_token_id)  # raises on a second END
        t.stop_sending(_Item(_KIND.FRAME_KIND_END, first_token_id=first_token_id))
        return t.out.future

    def abort(self, request_id: str, reason: str) -> None:
        with self._lock:
            t = self._transfers.get(request_id)
        if t is not None:
            self._fail(t, make_reason(Reason.ABORTED, reason), abort_payload=reason)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            transfers = list(self._transfers.values())
            channels = [c for pool in self._channels.values() for c in pool]
        for t in transfers:
            self._fail(t, make_reason(Reason.CLOSED), abort_payload="sender closed")
        self._sweeper.stop()
        for channel in channels:
            channel.close()

    # ---------------------------------------------------------------- internals

    def _get(self, request_id: str) -> _Transfer:
        with self._lock:
            t = self._transfers.get(request_id) or self._finished.get(request_id)
        if t is None:
            raise ValueError(f"no transfer for request {request_id!r}: call begin() first")
        return t

    def _channels_for(self, endpoints: tuple[str, ...]) -> list[grpc.Channel]:
        """Caller holds _lock. Channel i goes to endpoint i mod E."""
        n = self.config.num_streams
        for endpoint in endpoints:
            pool = self._channels.setdefault(endpoint, [])
            while len(pool) < -(-n // len(endpoints)):
                options = [*_CHANNEL_OPTIONS, ("pdserve.kv_stream", len(pool))]
                pool.append(pod_channel(endpoint, self.config.security, options, aio=False))
        return [self._channels[endpoints[i % len(endpoints)]][i // len(endpoints)]
                for i in range(n)]  # fmt: skip

    def _frames(self, t: _Transfer, index: int, begin: bytes) -> Iterator[bytes]:
        """Call `index`'s request stream of encoded KVFrames; runs on a gRPC thread."""
        yield begin
        rid = t.out.request_id
        flags = FLAG_XXH3 if self.config.checksum == "xxh3" else 0
        while (item := t.queues[index].get()) is not None:
            if t.out.done and item.kind != _KIND.FRAME_KIND_ABORT:
                continue  # failed: drain without sending
            if item.kind == _KIND.FRAME_KIND_DATA:
                assert item.piece is not None and item.host is not None
                item.host.wait()
                p = item.piece
                view = byte_view(item.host.tensor)[p.src_start : p.src_start + p.length]
                yield encode_data_frame(VERSION, item.kind, rid, p.layer, p.offset,
                                        data_checksum(view, flags), view, flags)  # fmt: skip
            elif item.kind == _KIND.FRAME_KIND_END:
                yield pdserve_pb2.KVFrame(
                    version=VERSION, kind=item.kind, request_id=rid, checksum=checksum(b""),
                    first_token_id=item.first_token_id, total_bytes=t.out.layout.total_bytes,
                ).SerializeToString()  # fmt: skip
            else:
                yield pdserve_pb2.KVFrame(
                    version=VERSION, kind=item.kind, request_id=rid, payload=item.payload,
                    checksum=checksum(item.payload),
                ).SerializeToString()  # fmt: skip

    def _call_done(self, t: _Transfer, index: int, call: grpc.Future) -> None:
        """A call finished (gRPC thread): the verdict (call 0 after END), a refusal, or
        a break. Call 0 finishing lets the other calls end."""
        try:
            result = call.result()
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            result = pdserve_pb2.PushResult(
                ok=False, reason=make_reason(Reason.CONNECTION_LOST, f"stream {index}: {code}"))
        except grpc.FutureCancelledError:
            result = pdserve_pb2.PushResult(
                ok=False, reason=make_reason(Reason.CONNECTION_LOST, f"stream {index} cancelled"))
        if not result.ok:
            self._fail(t, result.reason or make_reason(Reason.BAD_FRAME, "no reason given"))
        elif index == 0 and t.out.end_first_token is not None and t.closed:
            self._resolve(t, TransferOutcome.complete())
        if index == 0:
            t.release_calls()

    def _fail(self, t: _Transfer, reason: str, abort_payload: str | None = None) -> None:
        if self._resolve(t, TransferOutcome.failed(reason)):
            last = None
            if abort_payload is not None:
                payload = abort_payload.encode()[:1024]
                last = _Item(_KIND.FRAME_KIND_ABORT, payload=payload)
            t.stop_sending(last)

    def _resolve(self, t: _Transfer, outcome: TransferOutcome) -> bool:
        if not t.out.resolve(outcome):
            return False
        with self._lock:
            if self._transfers.get(t.out.request_id) is t:
                del self._transfers[t.out.request_id]
                self._finished[t.out.request_id] = t
                if len(self._finished) > _FINISHED_KEPT:
                    self._finished.popitem(last=False)
        return True

    def _sweep(self, now: float) -> None:
        with self._lock:
            late = [t for t in self._transfers.values()
                    if now > t.out.target.deadline + self.config.verdict_grace_s]  # fmt: skip
        for t in late:
            self._fail(t, make_reason(Reason.DEADLINE, "no verdict before the deadline"),
                       abort_payload="deadline")  # fmt: skip

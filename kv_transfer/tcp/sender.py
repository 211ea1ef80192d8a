"""TCP sender: one per prefill pod; slices each layer across N persistent streams.

Life of a transfer here: `begin` queues BEGIN on each of its N streams (stream
i of the pool for endpoint i mod E); `send_layer` stages the chunk on the host
(`HostStager`, D2H on a side stream on CUDA; head-major first for a
head-ranged layout, `KVLayout.staged`) and queues its row-aligned pieces
round-robin over the streams; `end` records the first token and END is queued
on stream 0 once every queued frame was sent. The outcome future resolves
with the receiver's STATUS verdict, or FAILED on abort, connection loss, a
refusal STATUS, or the target deadline (+ grace) passing (the collector).

KV TLS (tls.py): when `config.security` has TLS files whose `kv_streams` is
set, every stream is a TLS connection made with one client context built
here (the pod's certificate, the CA to verify decode pods).

Threads: caller threads enqueue only; each stream has a writer and a reader;
one collector sweeps deadlines.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future

import torch

from kv_transfer.base import KVLayout, KVSender, TransferOutcome, TransferTarget
from kv_transfer.config import SenderConfig
from kv_transfer.device import HostStager
from kv_transfer.errors import Reason, make_reason
from kv_transfer.outgoing import Outgoing
from kv_transfer.sweeper import Sweeper
from kv_transfer.tcp.frames import FrameKind, encode_begin, encode_end
from kv_transfer.tcp.stream import Stream, WorkItem
from kv_transfer.tcp.tls import client_context, kv_tls_files
from proto.request_id import check_request_id

# Resolved transfers kept for the engine's late send_layer/end calls: only a
# transfer that failed while its request was still prefilling sees them, so a
# few hundred cover any pod. An evicted one's late call is refused and its
# export fails, the end it had anyway. Each kept entry holds its future, and a
# future keeps its done-callbacks (and what they captured) alive: 4,096 of
# them cost the prefill pod ~25 MiB of RSS over a soak
# (benchmarks/results/history/soak.md, "Where the prefill pod's memory went").
_FINISHED_KEPT = 256


class TcpKVSender(KVSender):
    def __init__(self, config: SenderConfig | None = None) -> None:
        self.config = config or SenderConfig()
        files = kv_tls_files(self.config.security)
        self._tls = None if files is None else client_context(files)  # ValueError: bad files
        self._stager = HostStager()
        self._lock = threading.Lock()
        self._pools: dict[str, list[Stream]] = {}  # endpoint -> persistent streams
        self._transfers: dict[str, tuple[Outgoing, list[Stream]]] = {}
        # resolved transfers, kept so that the engine's late send_layer/end calls
        # see the outcome instead of an unknown id (bounded, oldest dropped)
        self._finished: OrderedDict[str, tuple[Outgoing, list[Stream]]] = OrderedDict()
        self._closed = False
        self._sweeper = Sweeper(self._sweep, self.config.sweep_interval_s, "kv-tcp-send-gc")
        self._sweeper.start()

    def begin(self, request_id: str, target: TransferTarget, layout: KVLayout, *,
              heads: tuple[int, int] | None = None, attempt: bytes | None = None,
              num_senders: int = 1) -> None:  # fmt: skip
        check_request_id(request_id)
        if target.transport != "tcp":
            raise ValueError(f"TcpKVSender cannot send to a {target.transport!r} target")
        t = Outgoing(request_id, target, layout, heads, attempt, num_senders)
        with self._lock:
            if self._closed:
                raise RuntimeError("TcpKVSender is closed")
            if request_id in self._transfers:
                raise ValueError(f"request {request_id!r} is already being sent")
            self._finished.pop(request_id, None)
            streams = self._streams_for(target.endpoints)
            self._transfers[request_id] = (t, streams)
        t.add_pending(len(streams))
        payload = encode_begin(layout, target.ticket, t.attempt, t.part, target.traceparent)
        for stream in streams:
            stream.enqueue(WorkItem(FrameKind.BEGIN, t, payload))

    def send_layer(self, request_id: str, layer: int, kv: torch.Tensor, token_start: int) -> None:
        t, streams = self._get(request_id)
        pieces = t.plan(layer, kv, token_start, len(streams), self.config.max_chunk_bytes,
                        self.config.min_chunk_bytes)  # fmt: skip
        if t.done:
            return
        host = self._stager.stage(t.layout.staged(kv))
        t.add_pending(len(pieces))
        with t.lock:
            first = t.next_stream
            t.next_stream = (first + len(pieces)) % len(streams)
        for i, piece in enumerate(pieces):
            item = WorkItem(FrameKind.DATA, t, piece=piece, host=host)
            streams[(first + i) % len(streams)].enqueue(item)

    def end(self, request_id: str, first_token_id: int) -> Future[TransferOutcome]:
        t, streams = self._get(request_id)
        if t.request_end(first_token_id):
            self._queue_end(t, streams)
        return t.future

    def abort(self, request_id: str, reason: str) -> None:
        with self._lock:
            entry = self._transfers.get(request_id)
        if entry is None:
            return
        t, streams = entry
        if self._resolve(t, TransferOutcome.failed(make_reason(Reason.ABORTED, reason)), False):
            self._queue_abort(t, streams, reason)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            transfers = [t for t, _ in self._transfers.values()]
            pools = [s for pool in self._pools.values() for s in pool]
        for t in transfers:
            self._resolve(t, TransferOutcome.failed(make_reason(Reason.CLOSED)))
        self._sweeper.stop()
        for stream in pools:
            stream.close()

    # ---------------------------------------------------------------- internals

    def _get(self, request_id: str) -> tuple[Outgoing, list[Stream]]:
        with self._lock:
            entry = self._transfers.get(request_id) or self._finished.get(request_id)
        if entry is None:
            raise ValueError(f"no transfer for request {request_id!r}: call begin() first")
        return entry

    def _streams_for(self, endpoints: tuple[str, ...]) -> list[Stream]:
        """Caller holds _lock. Stream i goes to endpoint i mod E."""
        n = self.config.num_streams
        per_endpoint = -(-n // len(endpoints))
        for endpoint in endpoints:
            if endpoint not in self._pools:
                self._pools[endpoint] = [
                    Stream(endpoint, self.config, self._on_status, self._on_sent, self._on_lost,
                           self._tls)
                    for _ in range(per_endpoint)
                ]
            pool = self._pools[endpoint]
            while len(pool) < per_endpoint:  # a later target spreads over fewer endpoints
                pool.append(
                    Stream(endpoint, self.config, self._on_status, self._on_sent, self._on_lost,
                           self._tls)
                )
        return [self._pools[endpoints[i % len(endpoints)]][i // len(endpoints)] for i in range(n)]

    def _queue_end(self, t: Outgoing, streams: list[Stream]) -> None:
        assert t.end_first_token is not None
        payload = encode_end(t.end_first_token, t.layout.total_bytes)
        streams[0].enqueue(WorkItem(FrameKind.END, t, payload))

    def _on_sent(self, t: Outgoing) -> None:
        if t.piece_done():
            with self._lock:
                entry = self._transfers.get(t.request_id)
            if entry is not None and entry[0] is t:
                self._queue_end(t, entry[1])

    def _on_status(self, request_id: str, ok: bool, reason: str) -> None:
        with self._lock:
            entry = self._transfers.get(request_id)
        if entry is not None:
            outcome = TransferOutcome.complete() if ok else TransferOutcome.failed(
                reason or make_reason(Reason.BAD_FRAME, "failure without reason"))  # fmt: skip
            self._resolve(entry[0], outcome)

    def _on_lost(self, t: Outgoing, reason: str) -> None:
        self._resolve(t, TransferOutcome.failed(reason))

    @staticmethod
    def _queue_abort(t: Outgoing, streams: list[Stream], reason: str) -> None:
        """ABORT on every stream (each sends it only if it carried this BEGIN, then
        forgets the transfer); the receiver acts on the first."""
        payload = reason.encode()[:1024]
        for stream in streams:
            stream.enqueue(WorkItem(FrameKind.ABORT, t, payload))

    def _resolve(self, t: Outgoing, outcome: TransferOutcome, unbind: bool = True) -> bool:
        """Set the outcome once and forget the transfer; `unbind` False leaves the
        streams' bindings for the queued ABORT frames to clear."""
        if not t.resolve(outcome):
            return False
        with self._lock:
            entry = self._transfers.get(t.request_id)
            if entry is not None and entry[0] is t:
                del self._transfers[t.request_id]
                self._finished[t.request_id] = entry
                if len(self._finished) > _FINISHED_KEPT:
                    self._finished.popitem(last=False)
        if entry is not None and unbind:
            for stream in entry[1]:
                stream.unbind(t.request_id)
        return True

    def _sweep(self, now: float) -> None:
        with self._lock:
            late = [
                (t, streams) for t, streams in self._transfers.values()
                if now > t.target.deadline + self.config.verdict_grace_s
            ]  # fmt: skip
        for t, streams in late:
            reason = make_reason(Reason.DEADLINE, "no verdict before the deadline")
            if self._resolve(t, TransferOutcome.failed(reason), False):
                self._queue_abort(t, streams, reason)

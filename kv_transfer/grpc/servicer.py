"""`KVTransfer.Push` servicer: one client stream = one sender stream of one transfer.

Every frame's `checksum` is xxhash64 of its `payload` (BEGIN: the sender's
attempt id, up to 16 bytes, shared by every sender of a head-ranged transfer,
whose BEGIN sets `flags` bit 3 and the head fields, as TCP's does; empty for
END, whose fields carry the data; the reason for ABORT), or XXH3-64 for a
DATA frame whose `flags` bit 1 is set.

Life of a call (a servicer thread; the servicer is synchronous, so it runs in a
`grpc.server` thread pool, or in a `grpc.aio.server(migration_thread_pool=...)`):

    first frame must be BEGIN -> ReceiveTable.begin (ticket, layout, version)
    DATA  -> claim the landing region, copy the payload in, verify the checksum, commit
    ABORT -> drop this sender's attempt (the transfer waits for another BEGIN)
    END   -> wait for the verdict (all streams' rows in) and return it
    the client closes its side without END -> PushResult(ok) for this stream;
        if its transfer is still open, the sender is taken as lost (see below)

The call's `PushResult` is the back channel. A call whose attempt was
superseded (another sender's BEGIN) answers its next frame, unapplied, with
PushResult(ok=False, "superseded: ..."). A transfer that fails while the
call is open (cancelled on this side, a bad frame on another stream) answers
at the call's next frame with PushResult(ok=False, reason); the client stops
sending once it sees it. A call that breaks (client killed, cancelled) drops
its attempt: the transfer waits for another sender's BEGIN (`sender_lost`).

Give the server enough threads: one per open stream (N per transfer in flight).
"""

from __future__ import annotations

import threading
import time

import grpc

from kv_transfer.base import KVLayout, TransferOutcome
from kv_transfer.checksum import checksum, checksum_name, data_checksum
from kv_transfer.errors import Reason, TransferRefused, make_reason, reason_code
from kv_transfer.grpc.codec import Malformed, WireFrame, decode_frame
from kv_transfer.layout import SenderPart
from kv_transfer.receive_table import ReceiveTable
from kv_transfer.wire import (
    FLAG_HEAD_RANGE,
    FLAG_TRACE,
    MAX_ATTEMPT_BYTES,
    MAX_DATA_BYTES,
    VERSION,
)
from proto import pdserve_pb2, pdserve_pb2_grpc
from telemetry import kv_traces

# options a server hosting the servicer needs (DATA frames exceed gRPC's 4 MiB default)
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_DATA_BYTES + (1 << 20)),
    ("grpc.max_send_message_length", 1 << 20),
]
_KIND = pdserve_pb2.FrameKind
SERVICE = "pdserve.v1.KVTransfer"


class _CallPeer:
    """The table's `Peer` for one call: holds the verdict until the handler reads it."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.outcome: TransferOutcome | None = None

    def notify(self, request_id: str, outcome: TransferOutcome) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self._event.set()

    def failed(self) -> bool:
        return self.outcome is not None and not self.outcome.ok

    def wait(self, timeout: float) -> TransferOutcome | None:
        self._event.wait(max(0.0, timeout))
        return self.outcome


def _result(outcome: TransferOutcome) -> pdserve_pb2.PushResult:
    return pdserve_pb2.PushResult(ok=outcome.ok, reason=outcome.reason)


def _refused(refused: TransferRefused) -> pdserve_pb2.PushResult:
    return pdserve_pb2.PushResult(ok=False, reason=refused.reason)


class KVTransferServicer(pdserve_pb2_grpc.KVTransferServicer):
    """Thin: frames in, table calls out. Add with `add_to_server`."""

    def __init__(self, table: ReceiveTable) -> None:
        self.table = table

    def add_to_server(self, server: grpc.Server) -> None:
        """Register `Push` with the connector's own request codec (codec.py)."""
        handlers = {
            "Push": grpc.stream_unary_rpc_method_handler(
                self.Push,
                request_deserializer=decode_frame,
                response_serializer=pdserve_pb2.PushResult.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),))  # fmt: skip
        server.add_registered_method_handlers(SERVICE, handlers)

    def Push(self, request_iterator, context) -> pdserve_pb2.PushResult:  # noqa: N802
        peer = _CallPeer()
        request_id = ""
        try:
            frames = iter(request_iterator)
            begin = next(frames, None)
            if begin is None:
                return pdserve_pb2.PushResult(ok=False, reason="bad_frame: empty stream")
            if isinstance(begin, Malformed):
                raise TransferRefused(Reason.BAD_FRAME, begin.why)
            request_id = begin.request_id
            self._begin(begin, peer)
            for frame in frames:
                if isinstance(frame, Malformed):  # this stream cannot be trusted any more
                    reason = make_reason(Reason.BAD_FRAME, frame.why)
                    self.table.peer_lost(peer, reason)
                    return pdserve_pb2.PushResult(ok=False, reason=reason)
                if peer.failed():
                    if reason_code(peer.outcome.reason) == Reason.SUPERSEDED.value:
                        self.table.stale_frame()  # a newer attempt owns the transfer
                    break
                result = self._handle(frame, peer)
                if result is not None:
                    return result
            if peer.failed():
                return _result(peer.outcome)
            # the stream ended without END: fine once its transfer is over (or this
            # attempt was dropped), otherwise the sender is gone. A cancelled call
            # can end the request iterator cleanly (gRPC's server sees the stream's
            # end before the cancellation), so the ending itself is the signal.
            self.table.peer_lost(peer, make_reason(
                Reason.CONNECTION_LOST, "the call ended before its transfer did"))  # fmt: skip
            return pdserve_pb2.PushResult(ok=True)
        except TransferRefused as refused:
            return _refused(refused)
        except Exception as exc:  # the call broke: client gone, cancelled, deadline
            if request_id:
                self.table.peer_lost(peer, make_reason(Reason.CONNECTION_LOST, str(exc)[:200]))
            raise

    def _begin(self, frame: WireFrame, peer: _CallPeer) -> None:
        if frame.version != VERSION:
            raise TransferRefused(Reason.BAD_FRAME, f"version {frame.version} != {VERSION}")
        if frame.kind != _KIND.FRAME_KIND_BEGIN:
            raise TransferRefused(Reason.BAD_FRAME, "the first frame of a stream must be BEGIN")
        if checksum(frame.payload) != frame.checksum:
            raise TransferRefused(Reason.BAD_CHECKSUM, "BEGIN payload")
        ranged = bool(frame.flags & FLAG_HEAD_RANGE)
        try:
            layout = KVLayout(frame.num_layers, frame.num_tokens, frame.num_kv_heads,
                              frame.head_dim, frame.dtype, frame.token_offset,
                              frame.head_start, frame.model_kv_heads)  # fmt: skip
            part = SenderPart(frame.sub_start, frame.sub_end, frame.num_senders) if ranged else (
                SenderPart.whole(layout))  # fmt: skip
        except ValueError as exc:
            raise TransferRefused(Reason.BAD_FRAME, str(exc)) from None
        if ranged != layout.head_ranged:  # the head fields travel behind the flag only
            raise TransferRefused(Reason.BAD_FRAME, "BEGIN head fields do not match its flags")
        attempt = bytes(frame.payload)
        if len(attempt) > MAX_ATTEMPT_BYTES:
            raise TransferRefused(Reason.BAD_FRAME, f"attempt id over {MAX_ATTEMPT_BYTES} bytes")
        self.table.begin(frame.request_id, bytes(frame.ticket), layout, peer, attempt, part)
        if frame.flags & FLAG_TRACE:  # the decode pod's spans (a bad one is not kept)
            kv_traces.note(frame.request_id, frame.traceparent)

    def _handle(self, frame: WireFrame, peer: _CallPeer) -> pdserve_pb2.PushResult | None:
        """One frame after BEGIN; a PushResult ends the call."""
        rid = frame.request_id
        payload = frame.payload  # a view of gRPC's message buffer
        if frame.kind == _KIND.FRAME_KIND_DATA:
            claim = self.table.claim(rid, peer, frame.layer, frame.offset, len(payload))
            claim.view[:] = payload  # the one copy on this side
            got = data_checksum(claim.view, frame.flags)
            ok = got == frame.checksum
            if not ok:  # the decode pod's span shows it (traced only)
                kv_traces.checksum_failure(
                    rid, layer=frame.layer, offset=frame.offset, bytes=len(payload),
                    expected=f"{frame.checksum:016x}", got=f"{got:016x}",
                    algorithm=checksum_name(frame.flags), transport="grpc")
            self.table.commit(claim, None if ok else make_reason(
                Reason.BAD_CHECKSUM, f"layer {frame.layer} offset {frame.offset}"))  # fmt: skip
            return None
        if checksum(payload) != frame.checksum:  # control frames: check before acting
            raise TransferRefused(Reason.BAD_CHECKSUM, f"frame kind {frame.kind} payload")
        if frame.kind == _KIND.FRAME_KIND_END:
            self.table.end(rid, peer, frame.first_token_id, frame.total_bytes)
            outcome = peer.wait(self.table.deadline_of(rid) + 1.0 - time.time())
            if outcome is None:  # the collector fails it at the deadline; do not wait on
                outcome = TransferOutcome.failed(make_reason(Reason.DEADLINE))
            return _result(outcome)
        if frame.kind == _KIND.FRAME_KIND_ABORT:
            self.table.abort(rid, peer, bytes(payload).decode(errors="replace"))
            return _result(TransferOutcome.failed(make_reason(Reason.ABORTED)))
        raise TransferRefused(Reason.BAD_FRAME, f"unexpected frame kind {frame.kind}")

"""One persistent sender connection to one receiver endpoint (a "stream").

Two threads per stream: the writer drains a FIFO of frames (so on one stream
BEGIN precedes DATA precedes END), connecting lazily; the reader reads the
receiver's STATUS frames (the back channel) for as long as the connection
lives. When a connection breaks, every transfer that sent BEGIN on it fails
with `connection_lost` (the receiver would refuse their remaining frames on a
new connection), and the next frame reconnects: a restarted receiver costs the
transfers in flight, never the ones after.

KV TLS (tls.py): with a client context the connection's TLS handshake runs
right after the TCP connect, within `connect_timeout_s`; a handshake that
fails (the decode pod's certificate not trusted, its KV port plaintext) is
`connect_failed` naming why. A receiver that refuses this pod's certificate
does so after the client's side of a TLS 1.3 handshake is done: the first
read or write then fails, `connection_lost` with the TLS alert. A plaintext
stream answered in TLS is told apart the same way.
"""

from __future__ import annotations

import logging
import queue
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.base import split_endpoint
from kv_transfer.checksum import FLAG_XXH3, checksum, data_checksum
from kv_transfer.config import SenderConfig
from kv_transfer.device import HostCopy, byte_view
from kv_transfer.errors import Reason, make_reason
from kv_transfer.outgoing import Outgoing, Piece
from kv_transfer.refusals import PortRefusal
from kv_transfer.tcp.frames import (
    FLAG_OK,
    FrameHeader,
    FrameKind,
    HeaderError,
    begin_flags,
    control_frame,
)
from kv_transfer.tcp.socket_io import (
    KVSocket,
    PeerClosed,
    close_quietly,
    new_header_buffer,
    recv_bytes,
    recv_header,
    send_frame,
    set_io_timeout,
)
from kv_transfer.tcp.tls import connect as tls_connect
from kv_transfer.tcp.tls import kv_tls_files, looks_like_tls

log = logging.getLogger(__name__)
# How long a failed write waits for the connection's reader to deliver the
# receiver's last STATUS (it ends at the receiver's close, at once).
_STATUS_GRACE_S = 0.5


@dataclass(frozen=True, slots=True)
class WorkItem:
    """A frame to send. DATA items hold the staged host copy until sent."""

    kind: FrameKind
    transfer: Outgoing
    payload: bytes = b""
    piece: Piece | None = None
    host: HostCopy | None = None


class _ConnectFailed(OSError):
    pass


class Stream:
    """Owned by TcpKVSender. `enqueue` from any thread; callbacks run on this
    stream's threads: `on_status(request_id, ok, reason)`, `on_sent(transfer)`
    after each counted frame, `on_lost(transfer, reason)`. `tls`: the
    sender's KV TLS client context (None: plaintext)."""

    def __init__(self, endpoint: str, config: SenderConfig,
                 on_status: Callable[[str, bool, str], None],
                 on_sent: Callable[[Outgoing], None],
                 on_lost: Callable[[Outgoing, str], None],
                 tls: ssl.SSLContext | None = None) -> None:  # fmt: skip
        self.endpoint = endpoint
        self._address = split_endpoint(endpoint)
        self._tls = tls
        files = kv_tls_files(config.security)
        # pods are dialled by IP: the certificate names --tls-server-name instead
        self._server_name = (files.server_name if files else None) or self._address[0]
        self._config = config
        self._on_status = on_status
        self._on_sent = on_sent
        self._on_lost = on_lost
        self._queue: queue.SimpleQueue[WorkItem | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._sock: KVSocket | None = None
        self._reader: threading.Thread | None = None  # the current connection's
        self._bound: dict[str, Outgoing] = {}  # BEGIN sent on the current connection
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name=f"kv-tcp-send-{endpoint}")  # fmt: skip
        self._writer.start()

    def enqueue(self, item: WorkItem) -> None:
        self._queue.put(item)

    def unbind(self, request_id: str) -> None:
        with self._lock:
            self._bound.pop(request_id, None)

    def close(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._writer.join(timeout=10)
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            close_quietly(sock)

    # ---------------------------------------------------------------- writer thread

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            sock = None
            try:
                sock = self._send(item)
            except OSError as exc:
                connect = isinstance(exc, _ConnectFailed)
                if not connect:
                    self._let_reader_tell_why()
                code = Reason.CONNECT_FAILED if connect else Reason.CONNECTION_LOST
                reason = make_reason(code, f"{self.endpoint}: {exc}")
                self._broken(sock, reason)
                self._on_lost(item.transfer, reason)
            except Exception:
                log.exception("kv sender stream %s failed on a frame", self.endpoint)
                self._on_lost(item.transfer, make_reason(Reason.BAD_FRAME, "sender error"))
            finally:
                if item.kind is not FrameKind.ABORT:
                    self._on_sent(item.transfer)

    def _send(self, item: WorkItem) -> KVSocket | None:
        t = item.transfer
        if item.kind is FrameKind.ABORT:
            with self._lock:  # only a connection that carried BEGIN can abort
                sock = self._sock if self._bound.pop(t.request_id, None) else None
            if sock is not None:
                sock.sendall(control_frame(FrameKind.ABORT, t.request_id, item.payload))
            return sock
        if t.done:
            return None  # failed or aborted: drop what is still queued
        sock = self._connect()
        if item.kind is FrameKind.BEGIN:
            with self._lock:
                self._bound[t.request_id] = t
        if item.kind is FrameKind.DATA:
            assert item.piece is not None and item.host is not None
            item.host.wait()  # D2H finished (CUDA); no-op on CPU
            p = item.piece
            view = byte_view(item.host.tensor)[p.src_start : p.src_start + p.length]
            flags = FLAG_XXH3 if self._config.checksum == "xxh3" else 0
            header = FrameHeader(FrameKind.DATA, t.request_id, p.layer, p.offset, p.length,
                                 data_checksum(view, flags), flags)  # fmt: skip
            send_frame(sock, header.pack(), view)
        else:
            flags = (begin_flags(t.layout, t.target.traceparent)
                     if item.kind is FrameKind.BEGIN else 0)
            sock.sendall(control_frame(item.kind, t.request_id, item.payload, flags))
        return sock

    def _connect(self) -> KVSocket:
        with self._lock:
            if self._sock is not None:
                return self._sock
        c = self._config
        try:
            plain = socket.create_connection(self._address, timeout=c.connect_timeout_s)
        except OSError as exc:
            raise _ConnectFailed(str(exc)) from None
        plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock: KVSocket = plain
        if self._tls is None:
            set_io_timeout(plain, c.io_timeout_s)
        else:
            try:
                sock = tls_connect(plain, self._tls, self._server_name, c.connect_timeout_s,
                                   c.io_timeout_s)
            except OSError as exc:
                raise _ConnectFailed(f"KV TLS handshake failed: {exc} (is KV TLS off on the "
                                     f"decode pod, or its certificate not for "
                                     f"{self._server_name!r}?)") from None
        reader = threading.Thread(target=self._read_loop, args=(sock,), daemon=True,
                                  name=f"kv-tcp-status-{self.endpoint}")  # fmt: skip
        with self._lock:
            self._sock, self._reader = sock, reader
        reader.start()
        return sock

    def _let_reader_tell_why(self) -> None:
        """A write failed: a receiver that refuses a connection says why in a
        STATUS and closes, and the write can fail (EPIPE) before the reader
        has read it. Give the reader up to `_STATUS_GRACE_S` to deliver that
        STATUS first, so the transfer fails with the receiver's reason (first
        outcome wins), not a bare broken pipe."""
        with self._lock:
            reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(_STATUS_GRACE_S)

    def _broken(self, sock: KVSocket | None, reason: str) -> None:
        """Forget `sock` (if still current) and fail every transfer bound to it."""
        with self._lock:
            if sock is None or self._sock is not sock:
                return
            self._sock = None
            bound, self._bound = self._bound, {}
        close_quietly(sock)
        for t in bound.values():
            self._on_lost(t, reason)

    # ---------------------------------------------------------------- reader thread

    def _read_loop(self, sock: KVSocket) -> None:
        buf = new_header_buffer()
        reason = make_reason(Reason.CONNECTION_LOST, f"{self.endpoint} closed the connection")
        try:
            while not self._stop.is_set():
                header = recv_header(sock, buf, self._stop)
                payload = recv_bytes(sock, header.length)
                if header.kind is not FrameKind.STATUS or checksum(payload) != header.checksum:
                    raise HeaderError(PortRefusal.BAD_KIND,
                                      f"unexpected {header.kind.name} frame from receiver")
                self._on_status(header.request_id, bool(header.flags & FLAG_OK),
                                payload.decode(errors="replace"))  # fmt: skip
        except PeerClosed:
            pass
        except HeaderError as exc:
            if self._tls is None and looks_like_tls(buf):
                exc = HeaderError(exc.reason, "it answered in TLS: KV TLS is on at the decode "
                                              "pod and off here (--no-kv-tls on one side)")
            reason = make_reason(Reason.CONNECTION_LOST, f"{self.endpoint}: {exc}")
        except OSError as exc:
            reason = make_reason(Reason.CONNECTION_LOST, f"{self.endpoint}: {exc}")
        self._broken(sock, reason)

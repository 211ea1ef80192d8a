"""`Lobby`: the TCP KV port's connections before they authenticate.

Anyone who can reach the port can open connections; only a sender holding
a valid ticket should cost the decode pod a thread or a connection slot. So
the accept thread keeps every new connection here, on one selector, with no
thread of its own and at most one frame's bytes (the 104-byte header and a
BEGIN payload of at most `MAX_CONTROL_BYTES`) buffered, until it has sent a
whole first frame:

* a BEGIN whose ticket verifies (HMAC, generation, expiry:
  `ReceiveTable.authenticate`) -> the connection is promoted: it gets its thread and a
  slot of `max_connections`, and the BEGIN is handled there as if just read;
* a BEGIN refused by its ticket (`bad_ticket`, `expired_ticket`,
  `wrong_generation`, `wrong_request`) -> counted, a STATUS frame with the
  reason sent back (best effort), and the connection stays here: that
  request's later frames are read and dropped (a sender streams them without
  waiting for the verdict), and a later BEGIN may still authenticate it (a
  real sender's pooled connection carries its next transfer);
* anything else -> closed and counted: a header that cannot be trusted by
  its refusal (`bad_magic`, ...), another frame (`not_begin`), no BEGIN
  with a valid ticket within `auth_timeout_s` of the connection
  (`auth_timeout`), or a frame begun and not complete within the port's
  `io_timeout_s` (`stalled`).

With KV TLS (tls.py) the connection first completes its TLS handshake here,
non-blocking, driven by the same selector (`do_handshake` on readiness); the
auth deadline covers handshake and BEGIN. A failed handshake (no or a bad
client certificate, plaintext bytes on a TLS port) is closed and counted
(`tls`), before any frame is read; so is a TLS handshake arriving on a
plaintext port. A peer that leaves mid-handshake is not counted, as one that
leaves before its first frame. Decrypted bytes can wait in the SSL object
where the selector does not see them (`SSLSocket.pending()`): a waiting
connection is read until none are left, and the promoted connection's
`TlsSocket` reads them before it waits on the socket.

Budgets, so a flood cannot crowd out real senders: at most `max_pending`
connections wait here (over it, the oldest is dropped: `pending_limit`),
and at most `max_pending_per_peer` from one address (over it, the new one is
closed: `peer_limit`). A real prefill pod's connection spends a round trip
here: it sends BEGIN as soon as it connects.

Threads: the receiver's accept thread runs `run` (and calls `on_tick`, its
frame watchdog, at least every `tick_s`); `close` from any thread after the
stop event is set.
"""

from __future__ import annotations

import logging
import selectors
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kv_transfer.checksum import checksum
from kv_transfer.errors import Reason, TransferRefused, make_reason
from kv_transfer.receive_table import ReceiveTable
from kv_transfer.refusals import PortRefusal, RefusalCounts
from kv_transfer.tcp.frames import (
    HEADER,
    MAGIC,
    MAX_CONTROL_BYTES,
    FrameHeader,
    FrameKind,
    HeaderError,
    control_frame,
    decode_begin,
    decode_header,
)
from kv_transfer.tcp.socket_io import KVSocket, close_quietly
from kv_transfer.tcp.tls import TLS_REFUSAL, RateLimitedLog, TlsSocket, looks_like_tls

log = logging.getLogger(__name__)

_ACCEPTS_PER_ROUND = 256
_SKIP_CHUNK = 256 << 10  # a refused request's payload is dropped in reads of this size
_REFUSED_KEPT = 64  # refused request ids a waiting connection remembers

# promote(sock, BEGIN header, its payload): the connection authenticated
Promote = Callable[[KVSocket, FrameHeader, bytes], None]
# the peer left mid-handshake (not counted, as a peer leaving before its first frame)
_PEER_LEFT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError)


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    peer: str
    deadline: float  # accepted + auth timeout; once the frame starts, also its io timeout
    buf: bytearray = field(default_factory=bytearray)
    header: FrameHeader | None = None
    started: bool = False
    refused: set[str] = field(default_factory=set)  # request ids whose BEGIN was refused
    skip_left: int = 0  # payload bytes of a refused request's frame still to drop
    handshaking: bool = False  # KV TLS: the handshake is not complete yet
    peeked: bool = False  # KV TLS: its first bytes were checked for a plaintext frame


@dataclass(frozen=True, slots=True)
class LobbyLimits:
    auth_timeout_s: float = 5.0
    io_timeout_s: float = 10.0
    max_pending: int = 256
    max_pending_per_peer: int = 64


class Lobby:
    def __init__(self, server: socket.socket, table: ReceiveTable, limits: LobbyLimits,
                 refusals: RefusalCounts, promote: Promote, stop: threading.Event, *,
                 on_tick: Callable[[], None] = lambda: None, tick_s: float = 0.2,
                 tls: ssl.SSLContext | None = None) -> None:
        self._server = server
        self._table = table
        self._limits = limits
        self._refusals = refusals
        self._promote = promote
        self._stop = stop
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._selector = selectors.DefaultSelector()
        self._pending: dict[socket.socket, _Pending] = {}  # insertion order: oldest first
        self._per_peer: Counter[str] = Counter()
        self._tls = tls  # KV TLS: the port's server context (tls.py); None: plaintext
        self._tls_log = RateLimitedLog()

    def __len__(self) -> int:
        return len(self._pending)

    def run(self) -> None:
        self._server.setblocking(False)
        self._selector.register(self._server, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(self._tick_s):
                    if key.fileobj is self._server:
                        self._accept()
                    elif (pending := self._pending.get(key.fileobj)) is not None:
                        self._serve(pending)
                self._expire(time.monotonic())
                self._on_tick()
        except OSError:
            if not self._stop.is_set():
                raise
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()

    # ------------------------------------------------------------ accept

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_ROUND):  # a flood must not starve the reads and deadlines
            try:
                sock, address = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            peer = address[0] if isinstance(address, tuple) else str(address)
            if self._per_peer[peer] >= self._limits.max_pending_per_peer:
                self._refusals.add(PortRefusal.PEER_LIMIT)
                close_quietly(sock)
                continue
            if len(self._pending) >= self._limits.max_pending:
                self._refusals.add(PortRefusal.PENDING_LIMIT)
                self._drop(next(iter(self._pending.values())))  # the oldest goes
            sock.setblocking(False)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True,
                                             do_handshake_on_connect=False)
            pending = _Pending(sock, peer, time.monotonic() + self._limits.auth_timeout_s,
                               handshaking=self._tls is not None)
            self._pending[sock] = pending
            self._per_peer[peer] += 1
            self._selector.register(sock, selectors.EVENT_READ)

    # ------------------------------------------------------------ TLS handshake

    def _serve(self, p: _Pending) -> None:
        """The connection is ready: handshake, or read; then read on while the
        SSL object holds decrypted bytes the selector cannot see."""
        if p.handshaking and not self._handshake(p):
            return
        self._read(p)
        while (self._pending.get(p.sock) is p and isinstance(p.sock, ssl.SSLSocket)
               and p.sock.pending()):
            self._read(p)

    def _handshake(self, p: _Pending) -> bool:
        """One step of the server handshake; True once it is complete."""
        assert isinstance(p.sock, ssl.SSLSocket)
        if not p.peeked:
            p.peeked = True
            if self._plaintext_sender(p):
                return False
        try:
            p.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._selector.modify(p.sock, selectors.EVENT_READ)
            return False
        except ssl.SSLWantWriteError:
            self._selector.modify(p.sock, selectors.EVENT_WRITE)
            return False
        except _PEER_LEFT:
            self._drop(p)
            return False
        except OSError as exc:  # ssl.SSLError: no or a bad certificate, not TLS at all
            self._refuse_tls(p, f"TLS handshake failed: {exc}")
            return False
        p.handshaking = False
        self._selector.modify(p.sock, selectors.EVENT_READ)
        return True

    def _plaintext_sender(self, p: _Pending) -> bool:
        """A plaintext KV frame on this TLS port (a sender with KV TLS off):
        refused and counted, and, when its whole header is in, told so in
        plaintext, so the sender fails with the reason instead of a bare EOF."""
        try:
            head = socket.socket.recv(p.sock, HEADER.size, socket.MSG_PEEK)
        except OSError:
            return False  # the handshake says what went wrong
        if not head or not MAGIC.startswith(head[: len(MAGIC)]):
            return False
        why = ("a plaintext KV sender on a TLS port: this decode pod has KV TLS on and "
               "the prefill pod has it off (--no-kv-tls on one side only?)")
        if len(head) == HEADER.size:
            try:
                frame = control_frame(FrameKind.STATUS, decode_header(head).request_id,
                                      make_reason(Reason.CONNECT_FAILED, why).encode())
                socket.socket.send(p.sock, frame)
            except (HeaderError, OSError):
                pass
        self._refuse_tls(p, why)
        return True

    def _refuse_tls(self, p: _Pending, why: str) -> None:
        self._refusals.add(TLS_REFUSAL)
        self._tls_log.warning("kv port refused a connection from %s: %s (counted in "
                              "pdserve_kv_port_refusals_total{reason=\"tls\"})", p.peer, why)
        self._drop(p)

    # ------------------------------------------------------------ the first frame

    def _read(self, p: _Pending) -> None:
        if p.skip_left:
            want = min(p.skip_left, _SKIP_CHUNK)
        else:
            want = (HEADER.size if p.header is None else HEADER.size + p.header.length) - len(p.buf)
        try:
            data = p.sock.recv(want)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except ssl.SSLError as exc:
            self._refuse_tls(p, f"TLS error: {exc}")
            return
        except OSError:
            data = b""
        if not data:  # the peer left before authenticating: nothing to count
            self._drop(p)
            return
        if not p.started:
            p.started = True
            p.deadline = min(p.deadline, time.monotonic() + self._limits.io_timeout_s)
        if p.skip_left:
            p.skip_left -= len(data)
            return
        p.buf += data
        try:
            if p.header is None and len(p.buf) == HEADER.size:
                p.header = self._next_header(p)
            if p.header is not None and len(p.buf) == HEADER.size + p.header.length:
                self._authenticate(p, p.header, bytes(p.buf[HEADER.size:]))
        except HeaderError as exc:
            if exc.reason == TLS_REFUSAL:
                self._refuse_tls(p, str(exc))
                return
            self._refusals.add(exc.reason)
            self._drop(p)

    @staticmethod
    def _next_header(p: _Pending) -> FrameHeader | None:
        """The frame's header; None when it is a refused request's frame, whose
        payload is then dropped (the sender streams a transfer's frames without
        waiting for BEGIN's verdict, and may reuse the connection next)."""
        if looks_like_tls(p.buf):
            raise HeaderError(TLS_REFUSAL, "a TLS handshake on a plaintext KV port: the "
                                           "sender has KV TLS on and this pod has it off "
                                           "(--no-kv-tls, or no --tls-cert-file)")
        header = decode_header(p.buf)
        if header.kind is not FrameKind.BEGIN:
            if header.request_id not in p.refused or header.kind is FrameKind.STATUS:
                raise HeaderError(PortRefusal.NOT_BEGIN,
                                  f"first frame is {header.kind.name}, not BEGIN")
            p.buf.clear()
            p.skip_left = header.length
            return None
        if header.length > MAX_CONTROL_BYTES:
            raise HeaderError(PortRefusal.OVERSIZED_LENGTH,
                              f"BEGIN of {header.length} bytes (at most {MAX_CONTROL_BYTES})")
        return header

    def _authenticate(self, p: _Pending, header: FrameHeader, payload: bytes) -> None:
        try:
            if checksum(payload) != header.checksum:
                raise TransferRefused(Reason.BAD_CHECKSUM, "BEGIN payload")
            _, ticket, _, _ = decode_begin(payload, header.flags)
            self._table.authenticate(header.request_id, ticket)
        except TransferRefused as refused:
            # told and counted; the connection stays here, unauthenticated, until
            # a BEGIN with a valid ticket or its deadline (a real sender's pooled
            # connection carries its next transfer; a stranger's is bounded)
            self._refusals.add(refused.code.value)
            self._tell(p.sock, header.request_id, refused)
            if len(p.refused) < _REFUSED_KEPT:
                p.refused.add(header.request_id)
            p.buf.clear()
            p.header = None
            return
        self._forget(p)
        sock: KVSocket
        if isinstance(p.sock, ssl.SSLSocket):
            sock = TlsSocket(p.sock)  # stays non-blocking; reads what the SSL object holds first
        else:
            sock = p.sock
            sock.setblocking(True)
        self._promote(sock, header, payload)

    @staticmethod
    def _tell(sock: socket.socket, request_id: str, refused: TransferRefused) -> None:
        """The refusal's reason back to the sender, if its socket takes it now."""
        reason = refused.reason.encode()[:MAX_CONTROL_BYTES]
        try:
            sock.send(control_frame(FrameKind.STATUS, request_id, reason))
        except OSError:
            pass

    # ------------------------------------------------------------ leaving

    def _expire(self, now: float) -> None:
        for p in [p for p in self._pending.values() if now >= p.deadline]:
            self._refusals.add(PortRefusal.STALLED if p.started else PortRefusal.AUTH_TIMEOUT)
            self._drop(p)

    def _forget(self, p: _Pending) -> None:
        del self._pending[p.sock]
        self._per_peer[p.peer] -= 1
        if not self._per_peer[p.peer]:
            del self._per_peer[p.peer]
        self._selector.unregister(p.sock)

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        close_quietly(p.sock)

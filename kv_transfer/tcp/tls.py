"""TLS on the TCP KV streams (KV TLS): the rule, the contexts, and `TlsSocket`.

The rule: a pod's TCP KV streams use TLS whenever its gRPC does (its
`PodSecurity.tls` is set), with the same files and the same mutual
authentication, unless `TlsFiles.kv_streams` is False (`--no-kv-tls`). The
decode pod's KV port presents the pod certificate and, when the pod requires
client certificates (`TlsFiles.mutual`), requires one signed by the CA; a
prefill pod's streams verify the decode pod's certificate against the CA (by
`server_name` when set: pods are dialled by IP) and present their own. Both
ends must agree: a mismatch fails the transfer and is counted, never
silently downgraded.

Who uses what: the receiver's lobby (lobby.py) wraps each accepted socket
with `server_context` and drives the handshake on its selector, then hands
the connection's thread a `TlsSocket`; a sender stream (stream.py) calls
`connect` after its TCP connect. socket_io.py's helpers take either kind of
socket.

Why `TlsSocket` and not a blocking `ssl.SSLSocket`: each KV connection has a
reader thread and writers on other threads (the receiver's STATUS frames come
from any thread; the sender's reader reads STATUS while its writer sends
DATA), and OpenSSL forbids SSL_read and SSL_write on one SSL object at once.
So the socket stays non-blocking, every call into OpenSSL holds a lock (it
never waits there), and waiting for the network happens outside the lock, in
`poll`. The receive path still decrypts straight into the caller's buffer
(the landing buffer: one copy, out of OpenSSL's record buffer).
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time

from kv_transfer.refusals import PortRefusal
from proto.tls import PodSecurity, TlsFiles

log = logging.getLogger(__name__)

# The refusal a failed handshake is counted under on the KV port
# (`pdserve_kv_port_refusals_total{reason="tls"}`): no or a bad client
# certificate, plaintext bytes on a TLS port, or a TLS client on a plaintext one.
TLS_REFUSAL = PortRefusal.TLS

# One SSL_write at most this much, so a reader waiting on the same
# connection's lock is never held up for long behind a 4 MiB frame.
_WRITE_SLICE = 256 << 10
_LOG_EVERY_S = 10.0


def kv_tls_files(security: PodSecurity) -> TlsFiles | None:
    """The files the TCP KV streams use, or None for plaintext (the rule above)."""
    tls = security.tls
    return tls if tls is not None and tls.kv_streams else None


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The decode pod's KV port: the pod's certificate; with `files.mutual`,
    client certificates signed by the CA required. ValueError on bad files.
    No session tickets: a KV connection lives as long as its pods, nothing
    resumes a session, and a ticket is a write after the handshake that a
    reader would have to make."""
    context = _tls13(files.ssl_context())
    context.num_tickets = 0
    return context


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """A prefill pod's KV streams: the CA verifies the decode pod, the pod's
    own certificate (when set) is its client certificate."""
    return _tls13(files.client_ssl_context())


def _tls13(context: ssl.SSLContext) -> ssl.SSLContext:
    """Both ends are pdserve pods, so TLS 1.3 only: no renegotiation, which
    `TlsSocket` does not do (a read that must write, a write that must read)."""
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


def looks_like_tls(first_bytes: bytes | bytearray | memoryview) -> bool:
    """Whether bytes start a TLS record (handshake 0x16 or alert 0x15, version
    3.x): what a plaintext end sees when the other end has KV TLS on."""
    return len(first_bytes) >= 2 and first_bytes[0] in (0x15, 0x16) and first_bytes[1] == 3


class RateLimitedLog:
    """A warning at most every `_LOG_EVERY_S` (a flood of bad handshakes must
    not flood the log; the counter has them all)."""

    def __init__(self) -> None:
        self._last = -_LOG_EVERY_S

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last >= _LOG_EVERY_S:
            self._last = now
            log.warning(message, *args)


def connect(sock: socket.socket, context: ssl.SSLContext, server_name: str,
            timeout_s: float, io_timeout_s: float) -> TlsSocket:
    """Client handshake on a connected socket, within `timeout_s`; OSError
    (ssl.SSLError among them) when it fails."""
    sock.settimeout(timeout_s)
    tls = context.wrap_socket(sock, server_hostname=server_name,
                              do_handshake_on_connect=False)
    try:
        tls.do_handshake()
    except OSError:
        tls.close()
        raise
    return TlsSocket(tls, io_timeout_s)


class TlsSocket:
    """A non-blocking `ssl.SSLSocket` behind the blocking socket calls the KV
    threads make (`recv_into`, `sendall`, `shutdown`, `close`, `fileno`,
    `setsockopt`), safe for one reader thread and any number of writer threads.

    Timeouts: a call that makes no progress for `io_timeout_s` raises
    TimeoutError, as a plaintext socket's kernel timeout does (idle between
    frames, a stall inside one). `shutdown` wakes a thread waiting in either.
    """

    def __init__(self, sock: ssl.SSLSocket, io_timeout_s: float | None = None) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._ssl_lock = threading.Lock()  # held for every call into OpenSSL, never while waiting
        self._write_lock = threading.Lock()  # one writer's records at a time, in order
        self._io_timeout_s = io_timeout_s
        self._closed = False

    def set_io_timeout(self, seconds: float) -> None:
        self._io_timeout_s = seconds

    def fileno(self) -> int:
        return self._sock.fileno()

    def setsockopt(self, *args) -> None:
        self._sock.setsockopt(*args)

    def version(self) -> str | None:
        return self._sock.version()

    # ------------------------------------------------------------ reading

    def recv_into(self, buffer: memoryview | bytearray, nbytes: int = 0, flags: int = 0) -> int:
        """Wait for at least one byte, then decrypt into `buffer` as many as are
        there without waiting (up to `nbytes`, default all of it); 0 at EOF.
        `flags` is accepted for the plaintext signature and ignored."""
        view = memoryview(buffer)
        size = nbytes or len(view)
        while True:
            got = self._read_ready(view, size)
            if got is not None:
                return got
            self._wait(select.POLLIN)

    def _read_ready(self, view: memoryview, size: int) -> int | None:
        """Bytes decrypted into `view` now; None when none are there yet."""
        got = 0
        with self._ssl_lock:
            self._check_open()
            while got < size:
                try:
                    n = self._sock.recv_into(view[got:size], size - got)
                except ssl.SSLWantReadError:
                    break
                except ssl.SSLWantWriteError:  # a read that must write: never asked for
                    raise ssl.SSLError("a TLS read that must write (renegotiation, key "
                                       "update) is not supported on KV streams") from None
                if n == 0:  # EOF (close_notify or a closed TCP connection)
                    return got
                got += n
        return got or None

    # ------------------------------------------------------------ writing

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        with self._write_lock:
            for start in range(0, len(view), _WRITE_SLICE):
                self._write(view[start : start + _WRITE_SLICE])

    def send_frame(self, header: bytes, payload: memoryview) -> None:
        """A header and its payload, the header in the payload's first TLS
        record (a record of its own would cost a segment and a wake-up at the
        receiver): the first 16 KiB of payload are copied once to join it."""
        first = 16384 - len(header)
        with self._write_lock:
            self._write(memoryview(header + bytes(payload[:first])))
            for start in range(first, len(payload), _WRITE_SLICE):
                self._write(payload[start : start + _WRITE_SLICE])

    def _write(self, piece: memoryview) -> None:
        """SSL_write without partial writes: one that would block must be
        retried with the same bytes until it reports them all written."""
        while piece:
            with self._ssl_lock:
                self._check_open()
                try:
                    piece = piece[self._sock.send(piece):]
                    continue
                except ssl.SSLWantWriteError:
                    pass
                except ssl.SSLWantReadError:  # a write that must read: never asked for
                    raise ssl.SSLError("a TLS write that must read (renegotiation) is not "
                                       "supported on KV streams") from None
            self._wait(select.POLLOUT)

    # ------------------------------------------------------------ waiting, closing

    def _wait(self, event: int) -> None:
        fd = self._sock.fileno()
        if fd < 0:
            raise OSError("TLS socket is closed")
        poller = select.poll()
        poller.register(fd, event)
        timeout_ms = -1 if self._io_timeout_s is None else int(self._io_timeout_s * 1000)
        if not poller.poll(timeout_ms):
            raise TimeoutError(f"no progress within {self._io_timeout_s:g} s")

    def _check_open(self) -> None:
        if self._closed:
            raise OSError("TLS socket is closed")

    def shutdown(self, how: int) -> None:
        """Shut the TCP connection down (no close_notify: a thread may be inside
        a read); SSLSocket.shutdown would also drop the SSL object under it."""
        socket.socket.shutdown(self._sock, how)

    def close(self) -> None:
        with self._ssl_lock:  # never under a thread inside OpenSSL
            self._closed = True
            self._sock.close()

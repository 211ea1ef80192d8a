"""Blocking socket helpers shared by the TCP sender and receiver threads.

Sockets stay in blocking mode and get their timeout from the kernel
(`SO_RCVTIMEO`/`SO_SNDTIMEO`, see `set_io_timeout`) rather than from
`settimeout`: a Python-level timeout makes CPython poll() before every
send/recv, doubling the syscalls of the data path. A timed-out call raises
BlockingIOError (or TimeoutError); between frames that is idleness and is
tolerated, inside a frame it means the peer stalled and the connection is
given up. A peer trickling a byte now and then makes progress on every recv,
so the receiver also bounds each whole frame (its watchdog, receiver.py).

Every helper also takes a `TlsSocket` (KV TLS, tls.py), which keeps those
semantics (a call without progress for the timeout raises TimeoutError) on a
socket that is non-blocking underneath.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable

from kv_transfer.tcp.frames import HEADER, FrameHeader, decode_header
from kv_transfer.tcp.tls import TlsSocket

# what the KV threads read and write: a plain TCP socket, or one with KV TLS
KVSocket = socket.socket | TlsSocket


def set_io_timeout(sock: KVSocket, seconds: float) -> None:
    """Blocking socket whose send/recv calls give up after `seconds` (kernel timeout)."""
    if isinstance(sock, TlsSocket):
        sock.set_io_timeout(seconds)
        return
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


_WAITALL = socket.MSG_WAITALL


class PeerClosed(Exception):
    """The peer closed the connection cleanly between frames."""


def recv_exact_into(sock: KVSocket, view: memoryview) -> None:
    """Fill `view` from `sock` (GIL released in recv_into; MSG_WAITALL makes it one
    call per payload unless a timeout splits it; with TLS, one call per burst of
    records already in, decrypted straight into `view`).

    Raises PeerClosed on EOF before the first byte, ConnectionError on EOF
    mid-way, TimeoutError when a recv makes no progress within the socket's timeout.
    """
    got = 0
    size = len(view)
    while got < size:
        n = sock.recv_into(view[got:], 0, _WAITALL)
        if n == 0:
            if got == 0:
                raise PeerClosed()
            raise ConnectionError(f"peer closed after {got} of {size} bytes")
        got += n


def send_frame(sock: KVSocket, header: bytes, payload: memoryview) -> None:
    """Header and payload in one `sendmsg` (gather): with TCP_NODELAY a separate
    send of the small header would leave as its own segment and wake the
    receiver once more per frame. Loops over partial sends like `sendall`.
    TLS has no gather: `TlsSocket.send_frame` puts the header in the payload's
    first record instead."""
    if isinstance(sock, TlsSocket):
        sock.send_frame(header, payload)
        return
    sent = sock.sendmsg([header, payload])
    if sent < len(header):
        sock.sendall(memoryview(header)[sent:])
        sent = len(header)
    if sent - len(header) < len(payload):
        sock.sendall(payload[sent - len(header) :])


def recv_header(sock: KVSocket, buf: bytearray, stop: threading.Event,
                on_first_bytes: Callable[[], None] | None = None) -> FrameHeader:  # fmt: skip
    """Wait (idle allowed) for the next header; raises HeaderError if untrustworthy.

    The first recv returns as soon as any bytes are there (no MSG_WAITALL), so
    `on_first_bytes` runs when the frame has started: the receiver starts the
    frame's deadline there, however slowly the rest arrives."""
    view = memoryview(buf)
    while True:
        try:
            got = sock.recv_into(view)
        except (TimeoutError, BlockingIOError):
            if stop.is_set():
                raise
            continue  # idle between frames
        if got == 0:
            raise PeerClosed()
        break
    if on_first_bytes is not None:
        on_first_bytes()
    if got < len(view):
        recv_exact_into(sock, view[got:])
    return decode_header(buf)


def new_header_buffer() -> bytearray:
    return bytearray(HEADER.size)


_SKIP_CHUNK = 256 << 10


def skip(sock: KVSocket, length: int) -> None:
    """Read and drop `length` payload bytes to stay in sync after a refused frame.
    The scratch buffer lives only as long as the call: an idle connection holds none."""
    scratch = memoryview(bytearray(min(length, _SKIP_CHUNK)))
    while length > 0:
        n = min(length, len(scratch))
        recv_exact_into(sock, scratch[:n])
        length -= n


def recv_bytes(sock: KVSocket, length: int) -> bytes:
    buf = bytearray(length)
    if length:
        recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def close_quietly(sock: KVSocket) -> None:
    """Shut down (wakes a thread blocked in recv on it) and close."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()

"""Blocking socket helpers shared by the TCP sender and receiver threads.

Sockets stay in blocking mode and get their timeout from the kernel
(`SO_RCVTIMEO`/`SO_SNDTIMEO`, see `set_io_timeout`) rather than from
`settimeout`: a Python-level timeout makes CPython poll() before every
send/recv, doubling the syscalls of the data path. A timed-out call raises
BlockingIOError (or TimeoutError); between frames that is idleness and is
tolerated, inside a frame it means the peer stalled and the connection is
given up.
"""

from __future__ import annotations

import socket
import struct
import threading

from kv_transfer.tcp.frames import HEADER, FrameHeader, decode_header


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking socket whose send/recv calls give up after `seconds` (kernel timeout)."""
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


class PeerClosed(Exception):
    """The peer closed the connection cleanly between frames."""


def recv_exact_into(sock: socket.socket, view: memoryview, *, idle_ok: bool = False,
                    stop: threading.Event | None = None) -> None:  # fmt: skip
    """Fill `view` from `sock` (GIL released in recv_into; MSG_WAITALL makes it one
    call per payload unless a timeout splits it).

    Raises PeerClosed on EOF before the first byte, ConnectionError on EOF
    mid-way, TimeoutError on a timeout mid-way (or at the start unless idle_ok).
    """
    got = 0
    size = len(view)
    while got < size:
        try:
            n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        except (TimeoutError, BlockingIOError):
            if got == 0 and idle_ok and not (stop is not None and stop.is_set()):
                continue
            raise
        if n == 0:
            if got == 0:
                raise PeerClosed()
            raise ConnectionError(f"peer closed after {got} of {size} bytes")
        got += n


def send_frame(sock: socket.socket, header: bytes, payload: memoryview) -> None:
    """Header and payload in one `sendmsg` (gather): with TCP_NODELAY a separate
    send of the small header would leave as its own segment and wake the
    receiver once more per frame. Loops over partial sends like `sendall`."""
    sent = sock.sendmsg([header, payload])
    if sent < len(header):
        sock.sendall(memoryview(header)[sent:])
        sent = len(header)
    if sent - len(header) < len(payload):
        sock.sendall(payload[sent - len(header) :])


def recv_header(sock: socket.socket, buf: bytearray, stop: threading.Event) -> FrameHeader:
    """Wait (idle allowed) for the next header; raises HeaderError if untrustworthy."""
    recv_exact_into(sock, memoryview(buf), idle_ok=True, stop=stop)
    return decode_header(buf)


def new_header_buffer() -> bytearray:
    return bytearray(HEADER.size)


def skip(sock: socket.socket, length: int, scratch: memoryview) -> None:
    """Read and drop `length` payload bytes to stay in sync after a refused frame."""
    while length > 0:
        n = min(length, len(scratch))
        recv_exact_into(sock, scratch[:n])
        length -= n


def recv_bytes(sock: socket.socket, length: int) -> bytes:
    buf = bytearray(length)
    if length:
        recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def close_quietly(sock: socket.socket) -> None:
    """Shut down (wakes a thread blocked in recv on it) and close."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()

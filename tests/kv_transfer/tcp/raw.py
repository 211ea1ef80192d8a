"""A hand-driven TCP client for tests: sends what a real sender never would."""

from __future__ import annotations

import socket

from kv_transfer.checksum import checksum
from kv_transfer.tcp.frames import FLAG_OK, HEADER, FrameHeader, FrameKind, decode_header


class RawClient:
    """Speaks the frame format by hand (to send what a real sender never would)."""

    # Hostile input comes from its own address (any 127.x is local on Linux):
    # the port's per-address budget for unauthenticated connections then
    # keeps it from crowding out the real senders on 127.0.0.1, as a
    # stranger's address would in a cluster.
    SOURCE = "127.0.0.9"

    def __init__(self, endpoint: str, source: str | None = SOURCE):
        host, port = endpoint.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30,
                                             source_address=(source, 0) if source else None)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def status(self) -> tuple[str, bool, str]:
        header = decode_header(self._read(HEADER.size))
        payload = self._read(header.length)
        assert header.kind is FrameKind.STATUS and checksum(payload) == header.checksum
        return header.request_id, bool(header.flags & FLAG_OK), payload.decode()

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, "receiver closed the connection"
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()


def data_frame(rid, layer, offset, payload, bad_checksum=False):
    digest = checksum(payload) ^ (1 if bad_checksum else 0)
    return FrameHeader(FrameKind.DATA, rid, layer, offset, len(payload), digest).pack() + payload


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the other end closed `sock` within `timeout` (EOF or reset)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False

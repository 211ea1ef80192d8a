"""The fault proxy itself, against a plain echo server: each fault does what
it says, and every connection it made is gone afterwards."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.faults.proxy import Fault, FaultProxy

pytestmark = pytest.mark.timeout(30)
PAYLOAD = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture
def echo():
    """An echo server on loopback; yields its (host, port)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[:2]
    stop.set()
    server.shutdown(socket.SHUT_RDWR)
    server.close()


@pytest.fixture
def proxy(echo):
    with FaultProxy(("127.0.0.1", 0), echo) as running:
        yield running


def _exchange(proxy: FaultProxy, payload: bytes = PAYLOAD, timeout: float = 5.0) -> bytes:
    """Send `payload`, half-close, read until EOF (or error): what came back."""
    host, port = proxy.address.rsplit(":", 1)
    received = bytearray()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while data := sock.recv(65536):
                received += data
        except OSError:
            pass
    return bytes(received)


def _wait_idle(proxy: FaultProxy) -> None:
    deadline = time.monotonic() + 5
    while proxy.active_connections():
        assert time.monotonic() < deadline, "a proxied connection stayed open"
        time.sleep(0.01)


def test_no_fault_forwards_every_byte_both_ways(proxy):
    assert _exchange(proxy) == PAYLOAD
    _wait_idle(proxy)
    assert proxy.bytes_forwarded == {"up": len(PAYLOAD), "down": len(PAYLOAD)}


def test_latency_and_bandwidth_slow_the_stream_but_keep_it_exact(proxy):
    proxy.set_fault(Fault(latency_s=0.05, bytes_per_s=64 * 1024))
    started = time.monotonic()
    assert _exchange(proxy) == PAYLOAD
    # 16 KiB at 64 KiB/s is >= 0.25 s each way, plus 50 ms per chunk
    assert time.monotonic() - started > 0.25


def test_corrupt_flips_exactly_one_byte(proxy):
    proxy.set_fault(Fault(corrupt_at_byte=1000))
    got = _exchange(proxy)
    assert len(got) == len(PAYLOAD)
    assert [i for i in range(len(got)) if got[i] != PAYLOAD[i]] == [1000]
    assert got[1000] == PAYLOAD[1000] ^ 0xFF


def test_truncate_cuts_the_stream_at_the_byte(proxy):
    proxy.set_fault(Fault(truncate_after_bytes=5000))
    assert _exchange(proxy) == PAYLOAD[:5000]
    _wait_idle(proxy)


def test_drop_resets_mid_stream(proxy):
    proxy.set_fault(Fault(drop_after_bytes=5000))
    got = _exchange(proxy)
    assert len(got) < len(PAYLOAD)
    _wait_idle(proxy)


def test_drop_downstream_counts_the_replies(proxy):
    proxy.set_fault(Fault(drop_after_bytes=3000, direction="down"))
    assert len(_exchange(proxy)) <= 3000
    _wait_idle(proxy)


def test_black_hole_answers_nothing_until_reset(proxy):
    proxy.set_fault(Fault(black_hole=True))
    host, port = proxy.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=0.3) as sock:
        sock.sendall(PAYLOAD)
        with pytest.raises(TimeoutError):
            sock.recv(10)
        proxy.reset_all()
        sock.settimeout(5)
        with pytest.raises(ConnectionResetError):
            sock.recv(10)
    _wait_idle(proxy)
    assert proxy.bytes_forwarded == {"up": 0, "down": 0}


def test_fault_applies_to_new_connections_only(proxy):
    proxy.set_fault(Fault(corrupt_at_byte=0))
    assert _exchange(proxy, b"ab") == b"\x9eb"
    proxy.set_fault(Fault())
    assert _exchange(proxy, b"ab") == b"ab"
    assert proxy.connections_accepted == 2


def test_bad_fault_is_refused():
    with pytest.raises(ValueError, match="direction must be one of"):
        Fault(direction="sideways")
    with pytest.raises(ValueError, match="bytes_per_s must be > 0, got 0"):
        Fault(bytes_per_s=0)


def test_fault_for_the_next_connections_only(proxy):
    proxy.set_fault(Fault(corrupt_at_byte=0), connections=1)
    assert _exchange(proxy, b"ab") == b"\x9eb"
    assert _exchange(proxy, b"ab") == b"ab"


def test_recordings_keep_what_each_connection_sent(echo):
    with FaultProxy(("127.0.0.1", 0), echo, record_limit=1000) as proxy:
        assert _exchange(proxy, b"abc") == b"abc"
        assert _exchange(proxy) == PAYLOAD
        assert [bytes(r) for r in proxy.recordings] == [b"abc", PAYLOAD[:1000]]


def test_refuse_then_start_again_on_the_same_address(proxy):
    address = proxy.address
    proxy.refuse()
    host, port = address.rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5)
    proxy.start()
    assert proxy.address == address
    assert _exchange(proxy, b"back") == b"back"

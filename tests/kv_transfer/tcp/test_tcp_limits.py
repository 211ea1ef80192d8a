"""The TCP KV port's limits, with real sockets: a whole-frame deadline (a
trickling peer is cut off), a cap on authenticated connections, refusals
counted by reason on the decode pod's metrics collector, authenticated idle
connections that cost a thread but no buffer, all returned when they close,
and connections that never authenticate, which cost no thread at all
(kv_transfer/tcp/lobby.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from decode_service.receiver_metrics import ReceiverCollector
from kv_transfer.base import KVLayout
from kv_transfer.config import ReceiverConfig
from kv_transfer.tcp import TcpKVReceiver
from kv_transfer.tcp.frames import (
    FrameHeader,
    FrameKind,
    control_frame,
    encode_begin,
    encode_end,
)
from kv_transfer.wire import MAX_DATA_BYTES
from tests.kv_transfer.helpers import RecordingListener, wait_until
from tests.kv_transfer.tcp.raw import RawClient, closed_by_peer, data_frame

pytestmark = pytest.mark.timeout(60)

FRAME_TIMEOUT_S = 1.0
LAYOUT = KVLayout(1, 64, 1, 16, "float32")  # 64-byte rows, 8 KiB per layer


def make_receiver(listener: RecordingListener, **config: object) -> TcpKVReceiver:
    rx = TcpKVReceiver(ReceiverConfig(capacity_bytes=8 << 20, **config), listener)
    rx.start()
    return rx


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_trickling_peer_is_cut_off_within_the_frame_deadline(where: str) -> None:
    listener = RecordingListener()
    rx = make_receiver(listener, io_timeout_s=FRAME_TIMEOUT_S)
    try:
        client = RawClient(rx.endpoints[0])
        frame = data_frame("t", 0, 0, bytes(4096))
        if where == "payload":  # a granted region, then its payload byte by byte
            target = rx.expect("t", LAYOUT, time.time() + 30)
            client.send(control_frame(FrameKind.BEGIN, "t",
                                      encode_begin(LAYOUT, target.ticket, b"a")))
            client.send(frame[:200])
            frame = frame[200:]
        stop = threading.Event()

        def trickle() -> None:  # one byte every 0.25 s: progress on every recv
            for byte in frame:
                if stop.wait(0.25):
                    return
                try:
                    client.sock.send(bytes([byte]))
                except OSError:
                    return

        started = time.monotonic()
        threading.Thread(target=trickle, daemon=True).start()
        try:
            assert closed_by_peer(client.sock, 10.0), "the trickling peer was not cut off"
        finally:
            stop.set()
        elapsed = time.monotonic() - started
        # the deadline counts from the frame's first byte; the watchdog wakes every 0.2 s
        assert FRAME_TIMEOUT_S - 0.3 < elapsed < FRAME_TIMEOUT_S + 1.0, elapsed
        assert rx.stats().refusals == {"stalled": 1}
        if where == "payload":  # the attempt is lost, not the transfer (a retry may come)
            restart = listener.wait_event("t", "restart")
            assert "stalled: frame not complete within 1 s" in restart[1]
        assert wait_until(lambda: rx.open_connections() == 0)
        client.close()
    finally:
        rx.close()


class SlowListener(RecordingListener):
    """Takes longer than the frame deadline to consume a layer (a busy injector)."""

    def on_layer_ready(self, request_id, layer, kv_view) -> None:
        time.sleep(FRAME_TIMEOUT_S + 0.5)
        super().on_layer_ready(request_id, layer, kv_view)


def test_the_frame_deadline_does_not_count_the_receivers_own_work() -> None:
    listener = SlowListener()
    rx = make_receiver(listener, io_timeout_s=FRAME_TIMEOUT_S)
    try:
        target = rx.expect("s", LAYOUT, time.time() + 30)
        client = RawClient(rx.endpoints[0])
        client.send(control_frame(FrameKind.BEGIN, "s", encode_begin(LAYOUT, target.ticket, b"a")))
        client.send(data_frame("s", 0, 0, bytes(LAYOUT.bytes_per_layer)))
        client.send(control_frame(FrameKind.END, "s", encode_end(7, LAYOUT.bytes_per_layer)))
        assert client.status() == ("s", True, "")
        assert listener.wait_event("s", "complete") == ("complete", 7)
        assert rx.stats().refusals == {}
        client.close()
    finally:
        rx.close()


def authenticated(rx: TcpKVReceiver, request_id: str) -> RawClient:
    """A connection that sent a BEGIN with a valid ticket: out of the lobby."""
    target = rx.expect(request_id, LAYOUT, time.time() + 60)
    client = RawClient(rx.endpoints[0], source=None)
    client.send(control_frame(FrameKind.BEGIN, request_id,
                              encode_begin(LAYOUT, target.ticket, b"a")))
    return client


def test_connections_over_the_cap_are_refused_and_counted() -> None:
    rx = make_receiver(RecordingListener(), max_connections=3)
    clients = []
    try:
        clients = [authenticated(rx, f"c{i}") for i in range(3)]
        assert wait_until(lambda: rx.stats().open_connections == 3)
        extra = authenticated(rx, "c3")
        assert closed_by_peer(extra.sock, 5.0)
        extra.close()
        assert rx.stats().refusals == {"connection_limit": 1}
        # below the cap again, a new connection is served (and held open)
        clients.pop().close()
        assert wait_until(lambda: rx.open_connections() == 2)
        clients.append(authenticated(rx, "c4"))
        assert wait_until(lambda: rx.open_connections() == 3)
        assert not closed_by_peer(clients[-1].sock, 0.3)
        assert rx.stats().refusals == {"connection_limit": 1}
    finally:
        for client in clients:
            client.close()
        rx.close()


def test_refusals_are_counted_by_reason_on_the_metrics_collector() -> None:
    rx = make_receiver(RecordingListener())
    registry = CollectorRegistry()
    ReceiverCollector(rx, "decode").register(registry)
    try:
        def refusals(reason: str) -> float | None:
            return registry.get_sample_value("pdserve_kv_port_refusals_total",
                                             {"role": "decode", "reason": reason})

        bad_magic = RawClient(rx.endpoints[0])
        bad_magic.send(b"GET / HTTP/1.1\r\n" + bytes(200))
        assert closed_by_peer(bad_magic.sock, 5.0)
        oversized = RawClient(rx.endpoints[0])
        oversized.send(FrameHeader(FrameKind.DATA, "o", length=MAX_DATA_BYTES + 1).pack())
        assert closed_by_peer(oversized.sock, 5.0)
        # a forged ticket; a DATA frame with a bad checksum: refused, connection kept
        forged = rx.expect("f", LAYOUT, time.time() + 30)
        client = RawClient(rx.endpoints[0])
        client.send(control_frame(FrameKind.BEGIN, "f",
                                  encode_begin(LAYOUT, b"x" * len(forged.ticket), b"a")))
        assert client.status()[2].startswith("bad_ticket")
        target = rx.expect("r", LAYOUT, time.time() + 30)
        good = RawClient(rx.endpoints[0])
        good.send(control_frame(FrameKind.BEGIN, "r", encode_begin(LAYOUT, target.ticket, b"a")))
        good.send(data_frame("r", 0, 0, bytes(4096), bad_checksum=True))
        assert good.status()[2].startswith("bad_checksum")
        assert wait_until(lambda: refusals("bad_checksum") == 1.0)
        assert refusals("bad_magic") == 1.0
        assert refusals("oversized_length") == 1.0
        assert refusals("bad_ticket") == 1.0
        # only `good` authenticated: the forged ticket's connection waits in the
        # lobby (no thread, no slot) for a valid BEGIN or its auth timeout
        assert registry.get_sample_value("pdserve_kv_port_connections",
                                         {"role": "decode"}) == 1.0
        for c in (bad_magic, oversized, client, good):
            c.close()
    finally:
        rx.close()


def test_idle_connections_hold_no_buffer_and_threads_return_to_baseline() -> None:
    rx = make_receiver(RecordingListener(), max_pending=200, max_pending_per_peer=200)
    num_connections = 100
    clients: list[RawClient] = []
    try:
        threads_before, rss_before = threading.active_count(), rss_bytes()
        clients = [authenticated(rx, f"i{i}") for i in range(num_connections)]
        assert wait_until(lambda: rx.open_connections() == num_connections)
        assert threading.active_count() == threads_before + num_connections
        # a thread (stack mostly untouched) but no buffer each: well under 1 MiB apiece
        grown = rss_bytes() - rss_before
        assert grown < 20 << 20, f"{num_connections} idle connections took {grown >> 20} MiB"
        for client in clients:
            client.close()
        clients = []
        assert wait_until(lambda: rx.open_connections() == 0)
        assert wait_until(lambda: threading.active_count() == threads_before)
        assert rss_bytes() - rss_before < 20 << 20
        assert rx.stats().refusals == {}
    finally:
        for client in clients:
            client.close()
        rx.close()


def test_connections_that_never_authenticate_cost_no_thread_and_are_closed_in_time() -> None:
    auth_timeout_s = 2.0
    rx = make_receiver(RecordingListener(), auth_timeout_s=auth_timeout_s, max_pending=400,
                       max_pending_per_peer=400)
    clients: list[RawClient] = []
    try:
        threads_before, rss_before = threading.active_count(), rss_bytes()
        clients = [RawClient(rx.endpoints[0]) for _ in range(300)]
        last_connected = time.monotonic()
        assert wait_until(lambda: rx.pending_connections()
                          + rx.stats().refusals.get("auth_timeout", 0) == 300)  # all accepted
        assert threading.active_count() == threads_before  # not one thread for them
        assert rss_bytes() - rss_before < 20 << 20
        assert rx.open_connections() == 0
        assert all(closed_by_peer(c.sock, 10.0) for c in clients)
        # each within the auth timeout of its accept, plus the loop's tick and slack
        assert time.monotonic() - last_connected < auth_timeout_s + 3.0
        assert rx.stats().refusals == {"auth_timeout": 300}
    finally:
        for client in clients:
            client.close()
        rx.close()


def test_a_flood_from_one_address_cannot_crowd_out_a_real_sender() -> None:
    rx = make_receiver(RecordingListener(), max_pending=32, max_pending_per_peer=8)
    flood: list[RawClient] = []
    try:
        flood = [RawClient(rx.endpoints[0]) for _ in range(100)]  # from 127.0.0.9
        assert wait_until(lambda: rx.stats().refusals.get("peer_limit") == 92)
        # a real sender (another address) authenticates and completes a transfer
        target = rx.expect("real", LAYOUT, time.time() + 30)
        sender = RawClient(rx.endpoints[0], source=None)
        sender.send(control_frame(FrameKind.BEGIN, "real",
                                  encode_begin(LAYOUT, target.ticket, b"a")))
        sender.send(data_frame("real", 0, 0, bytes(LAYOUT.total_bytes)))
        sender.send(control_frame(FrameKind.END, "real", encode_end(7, LAYOUT.total_bytes)))
        assert sender.status()[:2] == ("real", True)
        # a stranger's first frame that is not BEGIN, or a forged ticket: refused
        stranger = RawClient(rx.endpoints[0], source="127.0.0.10")
        stranger.send(data_frame("real", 0, 0, bytes(64)))
        assert closed_by_peer(stranger.sock, 5.0)
        assert rx.stats().refusals["not_begin"] == 1
        sender.close()
        stranger.close()
    finally:
        for client in flood:
            client.close()
        rx.close()

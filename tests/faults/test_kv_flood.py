"""300 idle connections to a decode pod's KV port (real pods, the router and
the openai client): they cost the pod no thread and little memory, they are
closed within the configured time, and meanwhile a prefill pod that has
never connected to it completes a transfer, its stream token-identical to
a colocated pod's. With KV TLS on, connections that never finish their TLS
handshake (or finish it and send nothing) are held and closed the same way."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from pathlib import Path

import openai
import pytest

from kv_transfer.base import KVLayout
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from proto.tls import PodSecurity, TlsFiles
from tests.integration.pods import start_pods
from tests.kv_transfer.helpers import RecordingListener, run_concurrent, wait_until
from tests.kv_transfer.tcp.raw import RawClient, closed_by_peer
from tests.router.router_process import start_router, wait_ready
from tests.tls_certs import SERVER_NAME, make_certs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FLOOD = 300
AUTH_TIMEOUT_S = 3.0
PER_PEER = 64  # the pod's default --kv-max-pending-per-peer
PROMPT = "A lighthouse keeper counts the ships that pass"


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _rss(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_flood_of_idle_connections_costs_no_threads_and_a_new_sender_gets_through(
        tiny_model_dir):
    pods = start_pods({
        "prefill": ("prefill", {"block_size": 16, "num_blocks": 256}),
        "decode": ("decode", {"block_size": 16, "num_blocks": 256,
                              "kv_auth_timeout": AUTH_TIMEOUT_S}),
        "reference": ("colocated", {"block_size": 16, "num_blocks": 256}),
    }, tiny_model_dir)
    flood: list[socket.socket] = []
    routers = []
    try:
        reference = start_router(tiny_model_dir, colocated=[pods["reference"].address])
        routers.append(reference)
        router = start_router(tiny_model_dir, prefill=[pods["prefill"].address],
                              decode=[pods["decode"].address], split_prefill_min_tokens=0,
                              local_prefill_max_tokens=0)
        routers.append(router)
        wait_ready(reference)
        wait_ready(router)

        def complete(r) -> str:
            client = openai.OpenAI(base_url=r.base_url, api_key="-", max_retries=0,
                                   timeout=60)
            chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                               temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        expected = complete(reference)
        decode = pods["decode"]
        pid = decode.process.pid
        threads_before, rss_before = _threads(pid), _rss(pid)
        for _ in range(FLOOD):  # a stranger's address: any 127.x is local
            sock = socket.create_connection(("127.0.0.1", decode.kv_port), timeout=10,
                                            source_address=("127.0.0.9", 0))
            flood.append(sock)
        flooded_at = time.monotonic()
        time.sleep(0.5)
        assert _threads(pid) <= threads_before + 2
        assert _rss(pid) - rss_before < 20 << 20
        # the prefill pod has never connected: its streams get through the flood
        assert complete(router) == expected
        assert all(closed_by_peer(sock, 10.0) for sock in flood)
        assert time.monotonic() - flooded_at < AUTH_TIMEOUT_S + 3.0

        def refusals(reason: str) -> float:
            return decode.metric_value("pdserve_kv_port_refusals_total", role="decode",
                                       reason=reason)

        assert refusals("peer_limit") == FLOOD - PER_PEER
        assert refusals("auth_timeout") == PER_PEER
        assert _threads(pid) <= threads_before + 2 + 4  # + the prefill pod's streams
    finally:
        for sock in flood:
            sock.close()
        for r in routers:
            r.terminate()
        for pod in pods.values():
            pod.kill()


def _client_hello(context: ssl.SSLContext) -> bytes:
    """The first flight of a real TLS client, without a connection."""
    out = ssl.MemoryBIO()
    hello = context.wrap_bio(ssl.MemoryBIO(), out, server_hostname=SERVER_NAME)
    with pytest.raises(ssl.SSLWantReadError):
        hello.do_handshake()
    return out.read()


def test_idle_tls_connections_cost_no_threads_and_are_closed_at_the_auth_timeout(tmp_path):
    certs = make_certs(tmp_path)
    security = PodSecurity(tls=TlsFiles(certs.pod_cert, certs.pod_key, certs.ca,
                                        server_name=SERVER_NAME))
    listener = RecordingListener()
    rx = TcpKVReceiver(ReceiverConfig(capacity_bytes=8 << 20, auth_timeout_s=AUTH_TIMEOUT_S,
                                      max_pending=400, max_pending_per_peer=400,
                                      security=security), listener)
    rx.start()
    client = security.tls.client_ssl_context()
    hello = _client_hello(client)
    idle: list[socket.socket] = []
    try:
        threads_before, rss_before = threading.active_count(), _rss(os.getpid())
        silent = [RawClient(rx.endpoints[0]).sock for _ in range(100)]
        halfway = [RawClient(rx.endpoints[0]).sock for _ in range(50)]
        for sock in halfway:  # a handshake begun and never finished
            sock.sendall(hello[: len(hello) // 2])
        shaken = []
        for _ in range(30):  # a handshake finished, and no BEGIN ever
            raw = RawClient(rx.endpoints[0]).sock
            shaken.append(client.wrap_socket(raw, server_hostname=SERVER_NAME))
        idle = silent + halfway + shaken
        last_connected = time.monotonic()
        assert wait_until(lambda: rx.pending_connections() + rx.stats().refusals.get(
            "auth_timeout", 0) == len(idle))
        assert threading.active_count() == threads_before  # not one thread for them
        # both ends' SSL objects live in this process: the port's share is less
        assert _rss(os.getpid()) - rss_before < 20 << 20
        assert rx.open_connections() == 0
        # meanwhile a real TLS sender gets through
        sender = TcpKVSender(SenderConfig(num_streams=4, security=security))
        try:
            run_concurrent(sender, rx, listener, [KVLayout(3, 40, 2, 16, "float32")], seed=1)
        finally:
            sender.close()
        assert all(closed_by_peer(sock, 10.0) for sock in idle)
        # closed by the auth timeout, every one (loose bound: the transfer ran meanwhile)
        assert time.monotonic() - last_connected < AUTH_TIMEOUT_S + 10.0
        assert rx.stats().refusals == {"auth_timeout": len(idle)}
    finally:
        for sock in idle:
            sock.close()
        rx.close()

"""KV TLS on the TCP connector (kv_transfer/tcp/tls.py), on loopback with real
sockets and throwaway certificates (tests/tls_certs.py): transfers are
byte-exact over mutual TLS at 1, 4 and 8 streams, with frames of many TLS
records; a sender without a valid client certificate, a plaintext sender, and
a TLS sender to a plaintext port are refused before any frame is read, and
counted as `tls`."""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer.base import KVLayout
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from proto.tls import PodSecurity, TlsFiles
from tests.kv_transfer.helpers import (
    RecordingListener,
    random_kv,
    run_concurrent,
    send_all,
    wait_until,
)
from tests.kv_transfer.tcp.test_tcp import ODD_LAYOUTS
from tests.tls_certs import SERVER_NAME, Certs, make_certs

pytestmark = pytest.mark.timeout(180)

# 4 layers of 4 MiB: DATA frames of the default 2-4 MiB, hundreds of TLS records each
BIG = KVLayout(4, 1024, 8, 64, "float32")
SMALL = KVLayout(2, 16, 2, 8, "float32")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("kv-tls"))


def pod_tls(certs: Certs, **changes) -> PodSecurity:
    """A pod's security as the pods' flags make it (mutual TLS, by server name)."""
    files = dict(cert_file=certs.pod_cert, key_file=certs.pod_key, ca_file=certs.ca,
                 server_name=SERVER_NAME)
    return PodSecurity(tls=TlsFiles(**{**files, **changes}))


@pytest.fixture
def listener():
    return RecordingListener()


@pytest.fixture
def tls_receiver(listener, certs):
    rx = TcpKVReceiver(ReceiverConfig(capacity_bytes=96 << 20, claim_grace_s=3.0,
                                      security=pod_tls(certs)), listener)
    rx.start()
    yield rx
    rx.close()


@pytest.mark.parametrize("num_streams", [1, 4, 8])
def test_transfers_over_mutual_tls_are_byte_exact(tls_receiver, listener, certs, num_streams):
    sender = TcpKVSender(SenderConfig(num_streams=num_streams, max_chunk_bytes=8192,
                                      security=pod_tls(certs)))
    try:
        run_concurrent(sender, tls_receiver, listener, ODD_LAYOUTS, seed=num_streams)
    finally:
        sender.close()
    assert tls_receiver.stats().refusals == {}


def test_frames_of_many_tls_records_land_byte_exact(tls_receiver, listener, certs):
    # default chunking (2-4 MiB frames): each payload is read over many records,
    # the sender's writes block on a full socket and resume
    sender = TcpKVSender(SenderConfig(num_streams=2, security=pod_tls(certs)))
    try:
        run_concurrent(sender, tls_receiver, listener, [BIG, BIG], seed=7)
    finally:
        sender.close()


def _refused_transfer(rx: TcpKVReceiver, listener: RecordingListener,
                      security: PodSecurity, request_id: str) -> str:
    """Send SMALL with `security` to `rx`; the sender's failure reason. Nothing
    may land: the receiver never promoted the connection."""
    target = rx.expect(request_id, SMALL, time.time() + 30)
    sender = TcpKVSender(SenderConfig(num_streams=1, security=security))
    try:
        sender.begin(request_id, target, SMALL)
        kv = random_kv(SMALL, torch.Generator().manual_seed(1))
        outcome = send_all(sender, request_id, kv, [], 5).result(30)
    finally:
        sender.close()
    assert not outcome.ok
    assert listener.events.get(request_id) is None  # no layer, no restart: nothing was read
    assert rx.open_connections() == 0
    assert rx.cancel(request_id, "test over")
    return outcome.reason


def only_tls_refusals(rx: TcpKVReceiver) -> bool:
    """Refused as `tls`, and nothing else counted. Once or more: a frame the
    sender had queued behind the broken connection may open another one."""
    refusals = rx.stats().refusals
    return set(refusals) == {"tls"} and refusals["tls"] >= 1


@pytest.mark.parametrize("client", ["no certificate", "another CA's certificate"])
def test_a_sender_without_a_valid_client_certificate_is_refused_and_counted(
        tls_receiver, listener, certs, client):
    security = (pod_tls(certs, cert_file=None, key_file=None) if client == "no certificate"
                else pod_tls(certs, cert_file=certs.rogue_cert, key_file=certs.rogue_key))
    reason = _refused_transfer(tls_receiver, listener, security, "stranger")
    # TLS 1.3: the client's side of the handshake ends before the server checks
    # its certificate, so the sender learns it from the alert on its first read
    assert reason.startswith("connection_lost"), reason
    assert wait_until(lambda: only_tls_refusals(tls_receiver))


def test_a_plaintext_sender_to_a_tls_port_is_refused_and_counted(tls_receiver, listener):
    reason = _refused_transfer(tls_receiver, listener, PodSecurity(), "plain")
    assert reason == ("connect_failed: a plaintext KV sender on a TLS port: this decode pod "
                      "has KV TLS on and the prefill pod has it off (--no-kv-tls on one "
                      "side only?)"), reason
    assert wait_until(lambda: only_tls_refusals(tls_receiver))


def test_a_tls_sender_to_a_plaintext_port_is_refused_and_counted(listener, certs):
    rx = TcpKVReceiver(ReceiverConfig(capacity_bytes=1 << 20), listener)
    rx.start()
    try:
        reason = _refused_transfer(rx, listener, pod_tls(certs), "tls-to-plain")
        assert reason.startswith("connect_failed") and "KV TLS handshake failed" in reason, reason
        assert wait_until(lambda: only_tls_refusals(rx))
    finally:
        rx.close()


def test_a_sender_that_does_not_trust_the_decode_pods_certificate_never_sends(
        tls_receiver, listener, certs):
    reason = _refused_transfer(tls_receiver, listener,
                               pod_tls(certs, ca_file=certs.rogue_cert), "distrust")
    assert reason.startswith("connect_failed") and "certificate verify failed" in reason, reason
    # the receiver sees the client's alert: counted too
    assert wait_until(lambda: only_tls_refusals(tls_receiver))


def test_no_kv_tls_keeps_the_tcp_streams_plaintext_beside_pod_tls(listener, certs):
    rx = TcpKVReceiver(ReceiverConfig(capacity_bytes=1 << 20,
                                      security=pod_tls(certs, kv_streams=False)), listener)
    rx.start()
    try:  # a sender with no TLS at all gets through: the port is plaintext
        for seed, security in enumerate((pod_tls(certs, kv_streams=False), PodSecurity())):
            sender = TcpKVSender(SenderConfig(num_streams=2, security=security))
            try:
                run_concurrent(sender, rx, listener, [SMALL], seed=seed)
            finally:
                sender.close()
        assert rx.stats().refusals == {}
    finally:
        rx.close()

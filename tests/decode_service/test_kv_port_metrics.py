"""A real decode pod's KV port limits, seen on its own /metrics: the flags
(--kv-max-connections, --kv-frame-timeout, --kv-auth-timeout) reach the
receiver, and refusals are counted by reason (`pdserve_kv_port_refusals_total`)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import grpc
import pytest

from kv_transfer.base import KVLayout
from kv_transfer.tcp.frames import FrameKind, control_frame, encode_begin
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.integration.pods import start_pod
from tests.kv_transfer.tcp.raw import closed_by_peer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_kv_port_refusals_and_connections_on_the_pods_metrics(tiny_model_dir: Path) -> None:
    pod = start_pod("decode", tiny_model_dir, kv_max_connections=1, kv_frame_timeout=0.5,
                    kv_auth_timeout=1.0)
    try:
        def value(name: str, **labels: str) -> float:
            try:
                return pod.metric_value(name, **labels)
            except KeyError:
                return 0.0

        def wait_connections(n: float) -> None:
            deadline = time.monotonic() + 10
            while value("pdserve_kv_port_connections") != n:
                assert time.monotonic() < deadline, pod.metrics_text()
                time.sleep(0.05)

        # A cut connection's slot is free once its reader thread has left,
        # which can trail the peer seeing the close: with one slot, the next
        # connection waits for it (else it is refused as over the limit).
        address = ("127.0.0.1", pod.kv_port)
        with socket.create_connection(address, timeout=10) as garbage:
            garbage.sendall(b"GET /metrics HTTP/1.1\r\n\r\n" + bytes(100))
            assert closed_by_peer(garbage, 10)
        wait_connections(0.0)
        with socket.create_connection(address, timeout=10) as trickle:
            trickle.sendall(b"PD")  # a frame that never completes
            assert closed_by_peer(trickle, 10)
        wait_connections(0.0)
        with socket.create_connection(address, timeout=10) as idle:  # never authenticates
            assert closed_by_peer(idle, 10)  # after --kv-auth-timeout
        # a connection takes the slot once it authenticated (a BEGIN with the
        # ticket of a real reservation); a second one is over the limit
        channel = grpc.insecure_channel(pod.address)
        call = pdserve_pb2_grpc.DecodeStub(channel).Generate(pb.DecodeGenerateRequest(
            request_id="held", prompt_token_ids=[5] * 20, remote_prefill=True,
            sampling=pb.SamplingParams(max_tokens=2)), timeout=60)
        ticket = next(call).reserved.target.ticket
        begin = control_frame(FrameKind.BEGIN, "held",
                              encode_begin(KVLayout(1, 1, 1, 1, "float32"), ticket, b"a"))
        with socket.create_connection(address, timeout=10) as held:
            held.sendall(begin)
            wait_connections(1.0)
            with socket.create_connection(address, timeout=10) as extra:
                extra.sendall(begin)
                assert closed_by_peer(extra, 10)
        call.cancel()
        channel.close()
        kind = "pdserve_kv_port_refusals_total"
        assert value(kind, reason="bad_magic") == 1.0
        assert value(kind, reason="stalled") == 1.0
        assert value(kind, reason="auth_timeout") == 1.0
        assert value(kind, reason="connection_limit") == 1.0
    finally:
        pod.kill()

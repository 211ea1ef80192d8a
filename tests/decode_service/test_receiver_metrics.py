"""`ReceiverCollector`: the decode pod's receiver counters on a real registry."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from decode_service.receiver_metrics import ReceiverCollector
from kv_transfer.base import KVLayout
from kv_transfer.config import ReceiverConfig
from kv_transfer.tcp import TcpKVReceiver
from kv_transfer.tcp.frames import FrameKind, control_frame, encode_begin
from tests.kv_transfer.helpers import RecordingListener, wait_until
from tests.kv_transfer.tcp.raw import RawClient, data_frame

pytestmark = pytest.mark.timeout(30)


def test_senders_lost_and_received_bytes_are_exported():
    listener = RecordingListener()
    receiver = TcpKVReceiver(ReceiverConfig(capacity_bytes=1 << 20), listener)
    receiver.start()
    registry = CollectorRegistry()
    ReceiverCollector(receiver, "decode").register(registry)
    try:
        layout = KVLayout(2, 4, 1, 16, "float32")  # 64-byte rows
        target = receiver.expect("m", layout, time.time() + 30)
        client = RawClient(receiver.endpoints[0])
        client.send(control_frame(FrameKind.BEGIN, "m", encode_begin(layout, target.ticket, b"1")))
        client.send(data_frame("m", 0, 0, bytes(128)))
        assert wait_until(lambda: receiver.stats().bytes_received == 128)
        client.close()
        listener.wait_event("m", "restart")
        sample = registry.get_sample_value
        assert sample("pdserve_kv_senders_lost_total", {"role": "decode"}) == 1.0
        assert sample("pdserve_kv_received_bytes_total", {"role": "decode"}) == 128.0
        assert b"# TYPE pdserve_kv_senders_lost_total counter" in generate_latest(registry)
    finally:
        receiver.close()


def test_empty_role_is_refused():
    with pytest.raises(ValueError, match="role must be a non-empty label value"):
        ReceiverCollector(TcpKVReceiver(ReceiverConfig(capacity_bytes=1 << 20),
                                        RecordingListener()), "")  # fmt: skip

"""The decode pod's `kv.receive_inject` detail (issue 39): a real TCP KV
receiver feeding a real `KVInjector`, driven by a hand-made sender
(tests/kv_transfer/tcp/raw.py). A BEGIN with a sampled traceparent gets one
`kv.layer` event per layer (bytes, arrived and injected ms since BEGIN), a
bad DATA checksum a `kv.checksum_failure` event (layer, offset, the expected
and the computed digest) and the span's error status; an unsampled or
untraced BEGIN, or any BEGIN with tracing off, records nothing."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from decode_service.injector import KVInjector, TransferFailed
from decode_service.servicer import _trace_receive
from engine.metrics import PodMetrics
from kv_transfer.base import KVLayout
from kv_transfer.config import ReceiverConfig
from kv_transfer.tcp import TcpKVReceiver
from kv_transfer.tcp.frames import FrameKind, begin_flags, control_frame, encode_begin, encode_end
from telemetry import kv_traces, tracing
from telemetry.pod_trace import PodTrace
from tests.kv_transfer.tcp.raw import RawClient, data_frame

pytestmark = pytest.mark.timeout(60)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SAMPLED = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
UNSAMPLED = f"00-{TRACE_ID}-00f067aa0ba902b7-00"
LAYOUT = KVLayout(num_layers=2, num_tokens=4, num_kv_heads=1, head_dim=64, dtype="float32")
LAYER_BYTES = LAYOUT.total_bytes // LAYOUT.num_layers


@pytest.fixture
def exporter(monkeypatch):
    """Tracing on in this process: a real SDK tracer whose spans stay in memory."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer(tracing.INSTRUMENTATION))
    yield spans
    provider.shutdown()


@pytest.fixture
def pod():
    """A receiver whose listener is an injector over a 1-block CPU cache per layer."""
    injector = KVInjector([torch.zeros(2, 1, 16, 1, 64) for _ in range(LAYOUT.num_layers)],
                          PodMetrics.create("decode"))
    receiver = TcpKVReceiver(ReceiverConfig(capacity_bytes=1 << 20), injector)
    receiver.start()
    yield receiver, injector
    receiver.close()
    injector.close()
    kv_traces._noted.clear()


def _transfer(receiver, injector, rid: str, traceparent: str, bad_layer: int | None = None):
    """Expect `rid`, send BEGIN (with `traceparent` if any), every layer (the
    checksum of `bad_layer` wrong) and END; the injector's verdict."""
    async def run():
        ready = injector.expect(rid, torch.arange(LAYOUT.num_tokens), LAYOUT.num_layers,
                                LAYOUT.total_bytes)
        target = receiver.expect(rid, LAYOUT, time.time() + 30)
        client = RawClient(receiver.endpoints[0])
        try:
            client.send(control_frame(FrameKind.BEGIN, rid,
                                      encode_begin(LAYOUT, target.ticket, b"", None, traceparent),
                                      begin_flags(LAYOUT, traceparent)))
            for layer in range(LAYOUT.num_layers):
                client.send(data_frame(rid, layer, 0, bytes([layer + 1]) * LAYER_BYTES,
                                       bad_checksum=layer == bad_layer))
            if bad_layer is None:
                client.send(control_frame(FrameKind.END, rid,
                                          encode_end(7, LAYOUT.total_bytes)))
            status = await asyncio.to_thread(client.status)
            try:
                return status, await asyncio.wait_for(ready, 10)
            except TransferFailed as exc:
                return status, exc
            finally:
                await injector.forget(rid)
        finally:
            client.close()
            receiver.release(rid)
    return asyncio.run(run())


def test_a_sampled_transfer_has_one_layer_event_per_layer(pod, exporter):
    receiver, injector = pod
    started = time.monotonic()
    assert _transfer(receiver, injector, "t", SAMPLED) == (("t", True, ""), 7)
    for rid, parent in (("unsampled", UNSAMPLED), ("plain", "")):
        assert _transfer(receiver, injector, rid, parent)[1] == 7
        assert kv_traces.take(rid) is None
    traced = kv_traces.traced("t")
    assert traced is not None and traced.traceparent == SAMPLED
    assert [(layer, size) for layer, size, _, _ in traced.layers] == [
        (0, LAYER_BYTES), (1, LAYER_BYTES)]
    assert all(started <= traced.begun <= arrived <= injected
               for _, _, arrived, injected in traced.layers)

    call = PodTrace("decode.request")  # over a Session stream: no metadata, no parent
    _trace_receive(call, "t", started, 0)  # the servicer's, once the KV is in
    assert call.traceparent == SAMPLED and kv_traces.take("t") is None
    call.finish()
    (receive,) = [s for s in exporter.get_finished_spans() if s.name == "kv.receive_inject"]
    assert format(receive.context.trace_id, "032x") == TRACE_ID
    assert [e.name for e in receive.events] == ["kv.layer", "kv.layer"]
    first = dict(receive.events[0].attributes)
    assert first["pdserve.layer"] == 0 and first["pdserve.bytes"] == LAYER_BYTES
    assert 0 <= first["pdserve.arrived_ms"] <= first["pdserve.injected_ms"]


def test_a_bad_checksum_is_an_event_and_the_spans_error(pod, exporter):
    receiver, injector = pod
    started = time.monotonic()
    status, failed = _transfer(receiver, injector, "c", SAMPLED, bad_layer=1)
    assert status == ("c", False, "bad_checksum: layer 1 offset 0")
    assert isinstance(failed, TransferFailed)
    call = PodTrace("decode.request")
    _trace_receive(call, "c", started, 0, failed.reason)
    call.finish(error=failed.reason)
    (receive,) = [s for s in exporter.get_finished_spans() if s.name == "kv.receive_inject"]
    assert receive.status.status_code is StatusCode.ERROR
    assert receive.status.description == "bad_checksum: layer 1 offset 0"
    assert [e.name for e in receive.events] == ["kv.layer", "kv.checksum_failure"]
    failure = dict(receive.events[1].attributes)
    assert {k: failure[f"pdserve.{k}"] for k in ("layer", "offset", "bytes", "algorithm",
                                                 "transport")} == {
        "layer": 1, "offset": 0, "bytes": LAYER_BYTES, "algorithm": "xxh64", "transport": "tcp"}
    assert failure["pdserve.stream"].startswith(f"{RawClient.SOURCE}:")
    # the frame said `expected`; the bytes hash to `got` (raw.py flips the last bit)
    assert int(failure["pdserve.expected"], 16) ^ int(failure["pdserve.got"], 16) == 1


def test_with_tracing_off_nothing_is_recorded(pod):
    receiver, injector = pod
    assert tracing.tracer() is None
    assert _transfer(receiver, injector, "off", SAMPLED)[1] == 7
    assert not kv_traces._noted and kv_traces.traced("off") is None

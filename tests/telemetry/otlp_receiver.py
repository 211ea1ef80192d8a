"""A real OTLP/gRPC trace receiver for tests: the collector's `TraceService`
(opentelemetry-proto) on a free loopback port, keeping every span it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class Span:
    """One received span, flattened: ids in hex, attributes as plain values."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    events: list = field(default_factory=list)  # names
    event_attributes: list = field(default_factory=list)  # (name, attributes) each
    error: bool = False
    status: str = ""  # the error status's description
    instance: str = ""  # the resource's service.instance.id


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind is not None else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    received.append(Span(
                        service=resource.get("service.name", ""), name=s.name,
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=[e.name for e in s.events],
                        event_attributes=[(e.name, {a.key: _value(a.value) for a in e.attributes})
                                          for e in s.events],
                        error=s.status.code == 2, status=s.status.message,
                        instance=resource.get("service.instance.id", "")))
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "spans") -> None:
        """Until `predicate()` holds (spans are exported in batches)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                with self._lock:
                    names = sorted({(s.service, s.name) for s in self.spans})
                raise AssertionError(f"{what} not received in {timeout}s; have {names}")
            time.sleep(0.1)

    def stop(self) -> None:
        self._server.stop(0)

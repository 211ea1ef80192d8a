"""Tracing and request timelines for every pdserve role (issue 39).

`telemetry.tracing`: the OpenTelemetry setup, off unless an OTLP endpoint is
given (the SDK and exporter are imported only then). `telemetry.context`:
W3C trace context from HTTP headers and gRPC metadata, and the traceparent
the KV BEGIN frame carries. `telemetry.spans`: spans made after the fact
from monotonic phase timestamps. `telemetry.history`: the router's ring of
finished requests' timelines behind `GET /debug/requests/{id}`.
"""

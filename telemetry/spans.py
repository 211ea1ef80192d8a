"""Spans made after the fact from timestamps taken at phase boundaries.

Phases record `time.monotonic()` as they start and end (cheap, always on:
router/flow/, the servicers); when the phase or the request ends and tracing
is on (telemetry.tracing.tracer() is not None), these helpers make the spans
with explicit start and end times, so nothing on a per-token path ever
touches OpenTelemetry. Monotonic seconds become wall-clock nanoseconds by
one offset taken at import.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from telemetry import tracing

# wall clock minus monotonic clock, in ns: a monotonic stamp's wall-clock time
_WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _WALL_OFFSET_NS


def parent_context(carrier: Mapping[str, str]):
    """The OpenTelemetry context of a W3C `carrier` (traceparent, tracestate);
    None when it has none (a new root). Tracing must be on."""
    if not carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    return TraceContextTextMapPropagator().extract(dict(carrier))


def carrier_of(span) -> dict[str, str]:
    """{traceparent, tracestate} naming `span` as the parent, for gRPC
    metadata or the KV BEGIN frame; {} for a span that is not recording."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier


def start(name: str, started: float, parent=None, attributes: Mapping[str, Any] | None = None,
          kind: str = "INTERNAL"):
    """A span begun at monotonic `started` under `parent` (a span or a
    context; None = a new root); end it with `end`. None when tracing is off."""
    tracer = tracing.tracer()
    if tracer is None:
        return None
    from opentelemetry import trace
    if parent is not None and not isinstance(parent, dict) and hasattr(parent, "get_span_context"):
        parent = trace.set_span_in_context(parent)
    return tracer.start_span(name, context=parent, kind=getattr(trace.SpanKind, kind),
                             attributes=_clean(attributes), start_time=wall_ns(started))


def end(span, ended: float, attributes: Mapping[str, Any] | None = None,
        error: str | None = None) -> None:
    """End `span` (None: tracing off) at monotonic `ended`."""
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error:
        from opentelemetry.trace import Status, StatusCode
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=wall_ns(ended))


def child(parent, name: str, started: float, ended: float,
          attributes: Mapping[str, Any] | None = None, error: str | None = None) -> None:
    """A finished child span of `parent` (None: tracing off) over [started, ended]."""
    if parent is None:
        return
    end(start(name, started, parent, attributes), ended, error=error)


def event(span, name: str, at: float, attributes: Mapping[str, Any] | None = None) -> None:
    """An event on `span` (None: off) at monotonic `at`."""
    if span is not None:
        span.add_event(name, attributes=_clean(attributes), timestamp=wall_ns(at))


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """OpenTelemetry takes str, bool, int, float and their sequences; None is left out."""
    if not attributes:
        return {}
    return {k: (list(v) if isinstance(v, (tuple, set, frozenset)) else v)
            for k, v in attributes.items() if v is not None}


def on() -> bool:
    """Tracing is on in this process."""
    return tracing.tracer() is not None

"""W3C trace context (https://www.w3.org/TR/trace-context/) as pdserve carries it.

The router reads `traceparent`/`tracestate` from a client's HTTP request
(router/http/server.py), sends its own span's context to the pods in gRPC
metadata (router/flow/), the pod servicers read it back (`from_metadata`),
and a prefill pod's KV sender puts the traceparent in the BEGIN frame
(kv_transfer/tcp/frames.py, FLAG_TRACE). Plain strings and no OpenTelemetry
import: with tracing off nothing here costs more than a dict lookup.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# version 00 only, as the spec's parsers must accept; lowercase hex
_PARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
TRACEPARENT_BYTES = 55  # "00-" + 32 + "-" + 16 + "-" + 2
MAX_TRACESTATE_CHARS = 512  # the spec's limit a receiver may keep


@dataclass(frozen=True, slots=True)
class TraceParent:
    """One valid traceparent: the trace, the parent span, its flags."""

    trace_id: str
    span_id: str
    flags: str = "01"

    @property
    def sampled(self) -> bool:
        return bool(int(self.flags, 16) & 1)

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"


def parse_traceparent(value: str | None) -> TraceParent | None:
    """`value` as a TraceParent; None when absent or invalid (the spec says
    an invalid traceparent starts a new trace rather than failing the request)."""
    if not value:
        return None
    match = _PARENT.match(value.strip())
    if match is None:
        return None
    trace_id, span_id, flags = match.groups()
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceParent(trace_id, span_id, flags)


@dataclass(frozen=True, slots=True)
class TraceOrigin:
    """Where a request's trace comes from: the client's headers (both None:
    a new root at the router), the API key name it was made with (the
    timeline endpoint shows a request to its own key only) and the model it
    named (an attribute of its spans)."""

    traceparent: str | None = None
    tracestate: str | None = None
    key_name: str | None = None
    model: str = ""


def from_headers(headers, key_name: str | None = None, model: str = "") -> TraceOrigin:
    """A client's trace context from HTTP `headers` (a case-insensitive mapping)."""
    parent = parse_traceparent(headers.get(TRACEPARENT))
    state = headers.get(TRACESTATE) if parent is not None else None
    if state is not None and len(state) > MAX_TRACESTATE_CHARS:
        state = None  # the spec lets a receiver drop an oversized tracestate
    return TraceOrigin(parent.header() if parent else None, state, key_name, model)


def to_metadata(carrier: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """gRPC metadata for an injected `carrier` (traceparent, tracestate)."""
    return tuple((k, v) for k, v in carrier.items() if k in (TRACEPARENT, TRACESTATE))


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """The trace context a pod call carried in its gRPC metadata (a carrier
    for `telemetry.tracing.parent_context`); {} when none."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if key in (TRACEPARENT, TRACESTATE) and isinstance(value, str):
            carrier[key] = value
    if parse_traceparent(carrier.get(TRACEPARENT)) is None:
        return {}
    return carrier

"""What a traced KV transfer saw on a decode pod, from its receiver and injector to its servicer.

A receiver thread that reads a BEGIN with FLAG_TRACE (kv_transfer/tcp/
receiver.py, the gRPC connector's servicer) `note`s it under the request id
when this process traces and the traceparent is sampled: a `TracedTransfer`
with the traceparent and the BEGIN's time. While the KV lands, the same
record collects the detail the decode pod's `kv.receive_inject` span shows as
events: each layer's bytes and its arrived / injected times
(decode_service/injector.py, `layer_in`) and each DATA frame whose checksum
failed (the receivers, `checksum_failure`). The decode servicer `take`s it
once the import ended (in or failed), adopts its traceparent (a request over
the router's Session stream has no per-call metadata) and turns it into
events (`events`) when the span is made.

Cost: with tracing off nothing is ever noted, so `traced` (read by the
injector per layer) is one falsy check of an empty map; an untraced or
unsampled request costs the same plus one dict miss. Only a sampled request
allocates, one small tuple per layer. The map is bounded (MAX_NOTED), so
transfers that never finish cannot grow it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from telemetry import tracing
from telemetry.context import parse_traceparent

MAX_NOTED = 4096  # traced transfers in flight on one pod, far more than a pod holds
MAX_CHECKSUM_EVENTS = 16  # per transfer: a corrupting link fails the transfer at the first


class TracedTransfer:
    """One sampled transfer's detail. `begun`: the first BEGIN's monotonic
    time (every time below is relative to it). `layers`: (layer, bytes,
    arrived, injected) per layer, written by the injector thread only, at most
    one per layer (a restart clears them: the layers come again). `failures`:
    (at, attributes) per checksum failure, from receiver threads."""

    __slots__ = ("traceparent", "begun", "layers", "failures")

    def __init__(self, traceparent: str, begun: float) -> None:
        self.traceparent = traceparent
        self.begun = begun
        self.layers: list[tuple[int, int, float, float]] = []
        self.failures: list[tuple[float, dict[str, Any]]] = []

    def layer_in(self, layer: int, num_bytes: int, arrived: float, injected: float) -> None:
        """Injector thread: `layer` (`num_bytes`) landed at `arrived` and was
        written into the cache at `injected` (on CUDA: its copy queued on the
        injector's stream)."""
        self.layers.append((layer, num_bytes, arrived, injected))

    def restart(self) -> None:
        """Injector thread: a new attempt sends every layer again."""
        self.layers.clear()

    def events(self) -> list[tuple[str, float, dict[str, Any]]]:
        """(name, at, attributes) for the span: `kv.layer` per layer (ms since
        BEGIN), then `kv.checksum_failure` per failure."""
        def ms(at: float) -> float:
            return round((at - self.begun) * 1000.0, 3)
        events = [("kv.layer", injected, {"layer": layer, "bytes": num_bytes,
                                          "arrived_ms": ms(arrived), "injected_ms": ms(injected)})
                  for layer, num_bytes, arrived, injected in self.layers]
        events += [("kv.checksum_failure", at, {**details, "at_ms": ms(at)})
                   for at, details in self.failures]
        return events


_lock = threading.Lock()
_noted: OrderedDict[str, TracedTransfer] = OrderedDict()


def note(request_id: str, traceparent: str) -> None:
    """A BEGIN for `request_id` carried `traceparent` ("" = none). Kept only
    when this process traces and the trace is sampled; a later BEGIN (another
    sender, a new attempt) keeps the first one's time."""
    if not traceparent or tracing.tracer() is None:
        return
    parent = parse_traceparent(traceparent)
    if parent is None or not parent.sampled:
        return
    with _lock:
        noted = _noted.get(request_id)
        if noted is None:
            _noted[request_id] = TracedTransfer(traceparent, time.monotonic())
            while len(_noted) > MAX_NOTED:
                _noted.popitem(last=False)
        else:
            noted.traceparent = traceparent


def traced(request_id: str) -> TracedTransfer | None:
    """The record of `request_id` when its BEGIN carried a sampled trace; None
    otherwise. No lock (one dict read): the injector asks once per layer."""
    if not _noted:  # tracing off, or no traced transfer in flight
        return None
    return _noted.get(request_id)


def checksum_failure(request_id: str, **details: Any) -> None:
    """A receiver thread found a DATA frame of `request_id` whose checksum
    did not match (`details`: layer, offset, expected, got, ...); kept for
    a traced transfer only."""
    record = traced(request_id)
    if record is not None and len(record.failures) < MAX_CHECKSUM_EVENTS:
        record.failures.append((time.monotonic(), details))


def take(request_id: str) -> TracedTransfer | None:
    """The record of `request_id`, forgotten now; None when none."""
    if not _noted:  # the common case with tracing off: no lock
        return None
    with _lock:
        return _noted.pop(request_id, None)

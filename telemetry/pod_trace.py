"""`PodTrace`: a pod call's phases, stamped as they pass, spans at its end.

The prefill and decode servicers make one per call (prefill_service/
servicer.py, decode_service/servicer.py) from the call's gRPC metadata
(the router's attempt span, telemetry.context.from_metadata), stamp
`phase`s with monotonic times at phase boundaries, and call `finish` once;
only then, and only when tracing is on and the call carried a trace
context, are the spans made: the call's span (SERVER, a child of the
router's attempt) with one child per phase, each with the events and the
error status its `phase` was given (the decode pod's `kv.receive_inject`:
its layers and checksum failures, telemetry.kv_traces).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from telemetry import spans
from telemetry.context import from_metadata


class PodTrace:
    """See the module docstring. `name`: the call's span, e.g. "prefill.request"."""

    __slots__ = ("name", "carrier", "started", "phases", "attributes", "_done")

    def __init__(self, name: str, metadata=None, **attributes: Any) -> None:
        self.name = name
        self.carrier = from_metadata(metadata) if spans.on() else {}
        self.started = time.monotonic()
        self.phases: list[_Phase] = []
        self.attributes: dict[str, Any] = dict(attributes)
        self._done = False

    @property
    def traceparent(self) -> str:
        """The traceparent this call carries on (e.g. in the KV BEGIN frame); "" = none."""
        return self.carrier.get("traceparent", "")

    def adopt(self, traceparent: str) -> None:
        """A traceparent learnt later (the KV BEGIN's, telemetry.kv_traces),
        for a call whose metadata carried none (the router's Session stream)."""
        if traceparent and not self.carrier and spans.on():
            self.carrier = {"traceparent": traceparent}

    def phase(self, name: str, start: float, end: float | None = None, *,
              events: Sequence[_Event] = (), error: str | None = None, **attributes: Any
              ) -> None:
        """Phase `name` ran from `start` to `end` (None: now); `events`: (name,
        monotonic time, attributes) on its span; `error`: its error status."""
        self.phases.append((name, start, time.monotonic() if end is None else end, attributes,
                            events, error))

    def finish(self, error: str | None = None, **attributes: Any) -> None:
        """The call ended; make its spans when tracing is on (once)."""
        if self._done:
            return
        self._done = True
        self.attributes.update(attributes)
        if not self.carrier or not spans.on():
            return  # a pod traces only calls of a traced request: no orphan roots
        root = spans.start(self.name, self.started, spans.parent_context(self.carrier),
                           _prefixed(self.attributes), kind="SERVER")
        for name, start, end, details, events, phase_error in self.phases:
            span = spans.start(name, start, root, _prefixed(details))
            for event, at, event_details in events:
                spans.event(span, event, at, _prefixed(event_details))
            spans.end(span, end, error=phase_error)
        spans.end(root, time.monotonic(), error=error)


T = TypeVar("T")
_Event = tuple[str, float, dict[str, Any]]
_Phase = tuple[str, float, float, dict[str, Any], Sequence[_Event], "str | None"]


async def finished_with(trace: PodTrace, messages: AsyncIterator[T]) -> AsyncIterator[T]:
    """`messages` passed through; `trace` finishes when they end: with no
    error, the exception's type and text, or "cancelled" (the caller left)."""
    error = "cancelled"
    try:
        async for message in messages:
            yield message
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        trace.finish(error)


def _prefixed(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k if "." in k else f"pdserve.{k}": v for k, v in attributes.items()}

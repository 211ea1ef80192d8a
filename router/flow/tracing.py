"""`FlowTrace`: one request's timeline and, when tracing is on, its spans.

`RequestFlow` makes one per request and calls it at phase boundaries only:
its state changes (`enter`), each attempt's start and end (`attempt`,
`attempt_failed`), what the pods' replies said (`note`), and the end
(`finish`), which puts the `Timeline` in the router's `History` and makes
the spans. Nothing here runs per token.

Spans (telemetry.spans; docs/tracing.md's table): `pdserve.request` (SERVER;
a child of the client's traceparent, else a new root), begun when the flow
starts so its context can go to the pods; under it one `pdserve.attempt`
per pod pair tried, whose context rides every pod call of that attempt in
gRPC metadata (`metadata`), so the pods' spans are its children; and the
router's phases (`router.<phase>`: admission wait, reserving, prefilling,
decoding, ...) made after the fact from the timeline's stamps.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from router.flow.state import FlowState
from router.generation import GenerationRequest
from telemetry import spans
from telemetry.context import TRACEPARENT, TRACESTATE, to_metadata
from telemetry.history import History, Timeline

log = logging.getLogger(__name__)

# the path an attempt took, by the last state that names one (router.metrics.PATHS;
# "split" is noted by router.flow.pd_path once the decode pod answers split_at)
_PATHS = {FlowState.COLOCATED: "colocated", FlowState.LOCAL_PREFILL: "local_prefill",
          FlowState.SCORING: "scoring", FlowState.PREFILLING: "disaggregated"}


class FlowTrace:
    """See the module docstring."""

    __slots__ = ("timeline", "_history", "_span", "_attempt_span", "_attempt")

    def __init__(self, request: GenerationRequest, history: History | None) -> None:
        origin = request.trace
        self.timeline = Timeline(request.request_id, origin.key_name if origin else None)
        self.timeline.attributes.update(
            model=(origin.model or None) if origin else None,
            prompt_tokens=len(request.prompt_token_ids),
            max_tokens=request.sampling.max_tokens, session=request.session_id)
        self.timeline.enter(FlowState.ROUTING.value, at=self.timeline.started)
        self._history = history
        self._attempt: dict[str, Any] | None = None
        self._attempt_span = None
        carrier = {}
        if origin is not None and origin.traceparent:
            carrier[TRACEPARENT] = origin.traceparent
            if origin.tracestate:
                carrier[TRACESTATE] = origin.tracestate
        self._span = spans.start("pdserve.request", self.timeline.started,
                                 spans.parent_context(carrier) if spans.on() else None,
                                 {"pdserve.request_id": request.request_id}, kind="SERVER")
        if self._span is not None:
            self.timeline.trace_id = format(self._span.get_span_context().trace_id, "032x")

    # ----------------------------------------------------- phase boundaries

    def enter(self, state: FlowState) -> None:
        """The flow's state changed (its phases are its states)."""
        if state in (FlowState.FINISHED, FlowState.FAILED):
            return
        self.timeline.enter(state.value)
        if self._attempt is not None:
            path = _PATHS.get(state)
            if path is not None:  # the latest: LOCAL_PREFILL refused -> RESERVING -> ...
                self._attempt["path"] = path

    @property
    def path(self) -> str | None:
        """The way the current attempt went (router.metrics.PATHS: its path
        state's, or "split" once its decode pod said so); None before it chose."""
        return self._attempt.get("path") if self._attempt is not None else None

    def attempt(self, request_id: str) -> tuple[tuple[str, str], ...]:
        """Attempt `request_id` starts; the gRPC metadata its pod calls carry."""
        self._attempt = {"attempt": len(self.timeline.attempts) + 1, "request_id": request_id}
        self.timeline.attempts.append(self._attempt)
        if self._span is None:
            return ()
        self._attempt_span = spans.start("pdserve.attempt", time.monotonic(), self._span,
                                         {"pdserve.request_id": request_id})
        return to_metadata(spans.carrier_of(self._attempt_span))

    def note(self, **details: Any) -> None:
        """What this attempt's pods are or said (decode=, prefill=, kv_bytes=, ...)."""
        if self._attempt is not None:
            self._attempt.update(details)

    def event(self, name: str, **details: Any) -> None:
        """A request-level event: first_token, retry, migration."""
        self.timeline.event(name, details)

    def attempt_ended(self, failure: str | None = None) -> None:
        if self._attempt is not None and failure is not None:
            self._attempt["failure"] = failure
        span, self._attempt_span = self._attempt_span, None
        if span is not None:
            spans.end(span, time.monotonic(), _span_attributes(self._attempt or {}),
                      error=failure)

    # ------------------------------------------------------------- the end

    def finish(self, outcome: str, output_tokens: int, cached_tokens: int | None) -> None:
        """The request ended: keep its timeline, make its spans."""
        timeline = self.timeline
        timeline.attributes.update(output_tokens=output_tokens, cached_tokens=cached_tokens)
        if timeline.attempts:
            last = timeline.attempts[-1]
            timeline.attributes.update(path=last.get("path"), decode=last.get("decode"),
                                       prefill=last.get("prefill"))
        timeline.finish(outcome)
        if self._attempt_span is not None:
            self.attempt_ended(None if outcome == "ok" else outcome)
        if self._history is not None:
            self._history.add(timeline)
        if self._span is not None:
            try:
                self._end_spans(outcome)
            except Exception:  # a tracing bug must never fail the request
                log.exception("request %s: its spans could not be made", timeline.request_id)

    def _end_spans(self, outcome: str) -> None:
        timeline, span = self.timeline, self._span
        for name, start, end, details in timeline.phases:
            spans.child(span, f"router.{name}", start, end, details)
        for name, at, details in timeline.events:
            spans.event(span, name, at, details)
        attributes = {f"pdserve.{k}": v for k, v in timeline.attributes.items()}
        attributes["pdserve.outcome"] = outcome
        attributes["pdserve.attempts"] = len(timeline.attempts)
        spans.end(span, timeline.ended, attributes, error=None if outcome == "ok" else outcome)


def _span_attributes(attempt: dict[str, Any]) -> dict[str, Any]:
    return {f"pdserve.{k}": v for k, v in attempt.items()
            if isinstance(v, (str, int, float, bool))}

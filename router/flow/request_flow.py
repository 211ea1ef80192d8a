"""One request's life through the pods.

The HTTP handlers and the gRPC servicer build a `RequestFlow` per client
request and iterate `run()` (an async generator of `Delta`s) on the router's
event loop inside `contextlib.aclosing`, so leaving early (client gone, task
cancelled) closes the generator at once, which cancels every pod call it has
open — the pods then free the request's blocks and buffers.

Life cycle (`FlowState`, transitions checked):

    ROUTING ─► RESERVING ─► PREFILLING ─► DECODING ─► FINISHED
       │  ▲    Decode.Generate  Prefill.Prefill to   tokens 1..n
       │  │    (remote_prefill) the Reserved target;
       │  │    answers Reserved the first token goes
       │  │                     to the client at once
       │  └─── MIGRATING ◄── decode pod failed / every prefill try failed
       ├─► COLOCATED: Decode.Generate(remote_prefill=false), tokens 0..n ─► FINISHED
       └─► LOCAL_PREFILL: the same on a decode pod (prefill is the bottleneck and
           the prompt is short, or it is below --local-prefill-below:
           router.routing.local_prefill) ─► FINISHED; the pod refused ─► RESERVING
    ROUTING ─► SCORING: max_tokens 0 on the P/D path — a prefill pod scores the
           prompt alone, no decode pod (router.flow.score_path) ─► FINISHED
    RESERVING ─► LOCAL_PREFILL: the decode pod's cached prefix left fewer new
           tokens than --local-prefill-below, so it computed the prompt itself
           and answered tokens instead of Reserved ─► FINISHED
    any state ─► FAILED (an ApiError for the client, or the client left)

Each try chooses its path once (`_path`) and runs it over one `PodCaller`
(router.flow.pod_caller: what every path's pod calls share): the P/D pair
(router.flow.pd_path, offered to the idle side while it waits:
router.flow.local_path.pd_with_idle_side), a colocated pod
(router.flow.colocated_path), a decode pod that prefills the prompt itself
(router.flow.local_path) or a prefill pod that scores it
(router.flow.score_path); this module decides what happens after one fails.

Failure handling:

* Decode.Generate answers RESOURCE_EXHAUSTED (pod full) or cannot be
  reached → the next decode pod (`pdserve_retries_total{role="decode"}`).
* Prefill.Prefill fails because the prefill pod is gone, broken or busy →
  another prefill pod against the same reservation (same KVTarget: endpoints
  + ticket), at most `max_prefill_retries` times
  (`pdserve_retries_total{role="prefill"}`). This is the normal path when a
  prefill pod dies mid-transfer: the decode pod's receiver keeps the
  reservation and restarts the transfer on the new pod's BEGIN
  (docs/kv_transfer.md), and its Generate stream stays open.
* Only when the decode side refused (the retry's Prefill answers ABORTED /
  DEADLINE_EXCEEDED: the transfer or the reservation is gone) does the
  request start over on a new pair (counted as a prefill retry).
* Prefill.Prefill streams the first token before the transfer's verdict; the
  client gets it at once. A transfer that fails after it (the prefill stream
  ends ABORTED or without its verdict, before the decode stream's first
  token) → MIGRATING with that token as output, like a broken decode stream:
  re-prefilling could sample a different first token than the one sent.
* The decode stream breaks (an error status, EOF without a finish reason, a
  gap in the indices, or the pod aborts the request) → MIGRATING: prompt +
  tokens so far go to a new pair as `output_token_ids`, and the assembler
  drops whatever the new pod repeats (`pdserve_migrations_total`). Bounded
  by `max_migrations`; a failed pod is left out for the rest of the request.
* Nothing to route to → `ApiError(503)` with the policy's reason.
* A stop string matched → the decode call is cancelled
  (`pdserve_aborts_total{reason="stop_string"}`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from router.api_error import ApiError
from router.flow import colocated_path, local_path, score_path
from router.flow.deps import FlowDeps
from router.flow.direct_relay import DeltaSink
from router.flow.output import Detokenizer, OutputAssembler
from router.flow.pod_caller import PodCaller
from router.flow.pod_calls import AttemptFailed, choose_path
from router.flow.state import FlowState, check_transition
from router.flow.tracing import FlowTrace
from router.generation import Delta, GenerationRequest
from router.key_limits import charge_current
from router.metrics import PathLatency
from router.routing.local_prefill import LocalChoice

log = logging.getLogger(__name__)


class RequestFlow:
    """Drives one `GenerationRequest` through the pods; see the module docstring."""

    def __init__(self, request: GenerationRequest, *, deps: FlowDeps, detokenizer: Detokenizer):
        self.request = request
        self.state = FlowState.ROUTING
        self._deps = deps
        self._out = OutputAssembler(
            detokenizer=detokenizer,
            stop=request.sampling.stop,
            num_prompt_tokens=len(request.prompt_token_ids),
        )
        self._start = time.monotonic()
        self._deadline = self._start + deps.settings.request_timeout
        self._left_out: set[str] = set()  # pods that failed this request
        self._last_failure: str | None = None  # why, the last time
        self._attempt = 0
        self._migrations = 0
        self._last_token_time: float | None = None
        # the latency histograms of this request's path, bound at its first
        # token (the path of the attempt that sent it), so the per-token ITL
        # observation picks no label
        self._latency: PathLatency | None = None
        self._sink: _ObservedSink | None = None
        # phase stamps for the timeline and the spans (router.flow.tracing)
        self.trace = FlowTrace(request, deps.history)

    def _to(self, state: FlowState) -> None:
        check_transition(self.request.request_id, self.state, state)
        self.state = state
        self.trace.enter(state)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._out.output_ids)

    # ------------------------------------------------------------ driver

    async def run(self, sink: DeltaSink | None = None) -> AsyncIterator[Delta]:
        """Yield the client's deltas; the last has finish_reason and usage.
        Raises ApiError for anything the client must be told. With `sink`
        (the client's stream), plain deltas of a steady decode may go
        straight to it instead (router.flow.direct_relay): the caller writes
        what is yielded, the relay the rest, in order."""
        if sink is not None:
            self._sink = _ObservedSink(sink, self._observe_tokens)
        metrics = self._deps.metrics
        metrics.in_flight.inc()
        outcome = "error"
        try:
            while True:
                try:
                    async with contextlib.aclosing(self._one_attempt()) as attempt:
                        async for delta in attempt:
                            self._observe(delta)
                            yield delta
                    outcome = "ok"
                    self._path_latency().e2e.observe(time.monotonic() - self._start)
                    return
                except AttemptFailed as failure:
                    self._after_failure(failure)
        except ApiError as exc:
            if exc.code == "no_pod_available" and self._last_failure is not None:
                # the pods left are none because this request failed on them: say why
                exc.message = f"{exc.message}; this request's last failure: {self._last_failure}"
                exc.args = (exc.message,)
            outcome = f"http_{exc.status}"
            # pods had the request and are told to drop it (their calls are cancelled)
            if exc.status == 504:
                metrics.aborts.labels(reason="timeout").inc()
            elif exc.code == "pod_failure":
                metrics.aborts.labels(reason="pod_failure").inc()
            self._to(FlowState.FAILED)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            # The consumer left: after the final delta that is just the end of
            # iteration; before it, the client went away mid-request.
            if self.state is FlowState.FINISHED:  # a consumer that stops at the final delta
                outcome = "ok"
                self._path_latency().e2e.observe(time.monotonic() - self._start)
            else:
                outcome = "client_disconnect"
                metrics.aborts.labels(reason="client_disconnect").inc()
                self._to(FlowState.FAILED)
            raise
        finally:
            metrics.in_flight.dec()
            metrics.requests.labels(outcome=outcome).inc()
            self.trace.finish(outcome, len(self._out.output_ids), self._out.cached_tokens)
            # the client's API key pays for what was computed, whatever the outcome
            charge_current(len(self.request.prompt_token_ids) + len(self._out.output_ids))

    def _observe(self, delta: Delta) -> None:
        if not delta.token_ids:
            return
        if self._out.next_index == len(delta.token_ids):
            now = time.monotonic()
            self._path_latency().ttft.observe(now - self._start)
            self._last_token_time = now
            self.trace.event("first_token")
        else:
            self._observe_tokens(len(delta.token_ids))

    def _observe_tokens(self, count: int) -> None:
        """ITL of `count` output tokens that arrived together, after the first."""
        now = time.monotonic()
        if self._last_token_time is not None:  # so the first token bound `_latency`
            self._latency.itl.observe((now - self._last_token_time) / count, count)
        self._last_token_time = now

    def _path_latency(self) -> PathLatency:
        """This request's path's histograms, bound the first time (its first
        token; the end, for a request that had none)."""
        if self._latency is None:
            self._latency = self._deps.metrics.for_path(self.trace.path)
        return self._latency

    def _after_failure(self, failure: AttemptFailed) -> None:
        """Decide whether the request moves on after a failed attempt."""
        self._left_out.update(failure.addresses)
        self._last_failure = failure.reason
        self.trace.attempt_ended(failure.reason)
        if failure.migrate:
            self._deps.metrics.migrations.inc()
        else:
            self._deps.metrics.retries.labels(role="prefill").inc()
        self.trace.event("migration" if failure.migrate else "retry", reason=failure.reason,
                         after_tokens=self._out.next_index)
        self._migrations += 1
        if self._migrations > self._deps.settings.max_migrations:
            raise ApiError(
                503,
                f"request failed on {self._migrations} pod pairs (limit --max-migrations "
                f"{self._deps.settings.max_migrations}); last failure: {failure.reason}",
                code="pod_failure",
            )
        log.warning("request %s moves to a new pod pair after %d tokens: %s",
                    self.request.request_id, self._out.next_index, failure.reason)
        self._to(FlowState.MIGRATING)
        self._to(FlowState.ROUTING)

    def _next_request_id(self) -> str:
        # One id per attempt: the decode pod's ticket binds it, and a pod that
        # still holds a failed attempt's state never confuses it with the next.
        self._attempt += 1
        return f"{self.request.request_id}-{self._attempt}"

    async def _one_attempt(self) -> AsyncIterator[Delta]:
        request_id = self._next_request_id()
        caller = PodCaller(self.request, request_id, deps=self._deps,
                           out=self._out, left_out=frozenset(self._left_out),
                           deadline=self._deadline, to_state=self._to, sink=self._sink,
                           trace=self.trace, metadata=self.trace.attempt(request_id))
        with contextlib.ExitStack() as stack:
            async with contextlib.aclosing(self._path(caller, stack)) as deltas:
                async for delta in deltas:
                    yield delta

    def _path(self, caller: PodCaller, stack: contextlib.ExitStack) -> AsyncIterator[Delta]:
        """This attempt's path, chosen once (its first state entered): a
        colocated pod, a prefill pod that scores the prompt (max_tokens 0),
        a decode pod that prefills it itself (counted as computing there
        until `stack` closes), or the P/D pair."""
        path = choose_path(self._deps.pool, self._left_out, self._deps.colocated_gate,
                           len(self.request.prompt_token_ids))
        if path == "colocated":
            self._to(FlowState.COLOCATED)
            return colocated_path.colocated(caller)
        if self.request.sampling.max_tokens == 0:
            self._to(FlowState.SCORING)
            return score_path.scored(caller)
        local = self._choose_local()
        if local is not None:
            self._to(FlowState.LOCAL_PREFILL)
            log.debug("request %s: decode pod %s prefills its %d new tokens itself "
                      "(%d tokens ahead on the prefill path)", self.request.request_id,
                      local.address, local.new_tokens, local.tokens_ahead)
            first_token = stack.enter_context(self._deps.local_prefill.computing(local))
            return local_path.local_prefill(caller, local.address, first_token)
        self._to(FlowState.RESERVING)
        return local_path.pd_with_idle_side(caller)

    def _choose_local(self) -> LocalChoice | None:
        """The decode pod that prefills this attempt itself, or None (the P/D path)."""
        rule = self._deps.local_prefill
        if rule is None or not rule.settings.enabled:
            return None
        return rule.choose(
            (*self.request.prompt_token_ids, *self._out.output_ids),
            max_context=len(self.request.prompt_token_ids) + self.request.sampling.max_tokens,
            exclude=frozenset(self._left_out))


class _ObservedSink:
    """The client's sink, with the flow's ITL observation of each batch the
    direct relay writes (as `run` does for the deltas it yields; the relay
    never has the first token)."""

    __slots__ = ("ready", "_send_text", "_observe_tokens")

    def __init__(self, sink: DeltaSink, observe_tokens: Callable[[int], None]) -> None:
        self.ready = sink.ready
        self._send_text = sink.send_text
        self._observe_tokens = observe_tokens

    def send_text(self, text: str, token_ids: Sequence[int]) -> None:
        self._observe_tokens(len(token_ids))
        self._send_text(text, token_ids)

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
       └─► COLOCATED: Decode.Generate(remote_prefill=false), tokens 0..n ─► FINISHED
    any state ─► FAILED (an ApiError for the client, or the client left)

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
from collections.abc import AsyncIterator

import grpc

from proto import pdserve_pb2 as pb
from router.api_error import ApiError
from router.flow.output import (
    Detokenizer,
    OutputAssembler,
    OutputGap,
    fold_final,
    logprobs_from_proto,
)
from router.flow.pod_calls import (
    AttemptFailed,
    FlowDeps,
    choose_path,
    client_error,
    describe,
    sampling_message,
)
from router.flow.state import FlowState, check_transition
from router.generation import Delta, GenerationRequest
from router.routing.base import NoPodAvailable

log = logging.getLogger(__name__)


# Prefill errors that say the pod itself is gone or broken (as opposed to
# the KV transfer or the reservation having failed).
_BROKEN_POD = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
})


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
        self._attempt = 0
        self._migrations = 0
        self._last_token_time: float | None = None

    def _to(self, state: FlowState) -> None:
        check_transition(self.request.request_id, self.state, state)
        self.state = state

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._out.output_ids)

    # ------------------------------------------------------------ driver

    async def run(self) -> AsyncIterator[Delta]:
        """Yield the client's deltas; the last has finish_reason and usage.
        Raises ApiError for anything the client must be told."""
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
                    metrics.e2e.observe(time.monotonic() - self._start)
                    return
                except AttemptFailed as failure:
                    self._after_failure(failure)
        except ApiError as exc:
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
            if self.state is not FlowState.FINISHED:
                outcome = "client_disconnect"
                metrics.aborts.labels(reason="client_disconnect").inc()
                self._to(FlowState.FAILED)
            raise
        finally:
            metrics.in_flight.dec()
            metrics.requests.labels(outcome=outcome).inc()

    def _observe(self, delta: Delta) -> None:
        out, metrics = self._out, self._deps.metrics
        if not delta.token_ids:
            return
        now = time.monotonic()
        if out.next_index == len(delta.token_ids):
            metrics.ttft.observe(now - self._start)
        elif self._last_token_time is not None:
            gap = (now - self._last_token_time) / len(delta.token_ids)
            for _ in delta.token_ids:
                metrics.itl.observe(gap)
        self._last_token_time = now

    def _after_failure(self, failure: AttemptFailed) -> None:
        """Decide whether the request moves on after a failed attempt."""
        self._left_out.update(failure.addresses)
        if failure.migrate:
            self._deps.metrics.migrations.inc()
        else:
            self._deps.metrics.retries.labels(role="prefill").inc()
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

    def _remaining(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise ApiError(
                504,
                "the request did not finish within --request-timeout "
                f"{self._deps.settings.request_timeout:g}s",
            )
        return left

    def _pod_failed(self, error: grpc.aio.AioRpcError, address: str) -> None:
        """A pod call failed. Raise the client's error when it is one (bad input,
        the client's own deadline); otherwise mark an unreachable pod so routing
        skips it, and return: the caller retries or moves the request."""
        api_error = client_error(error, address, self._deps.settings.request_timeout)
        # A 504 with time left is the pod's own deadline: another pod may do it.
        if api_error is not None and not (api_error.status == 504
                                          and self._deadline - time.monotonic() > 1.0):
            raise api_error from None
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            self._deps.pool.mark_unhealthy(address, describe(error))

    def _next_request_id(self) -> str:
        # One id per attempt: the decode pod's ticket binds it, and a pod that
        # still holds a failed attempt's state never confuses it with the next.
        self._attempt += 1
        return f"{self.request.request_id}-{self._attempt}"

    # ------------------------------------------------------------ one attempt

    async def _one_attempt(self) -> AsyncIterator[Delta]:
        if choose_path(self._deps.pool, self._left_out) == "colocated":
            self._to(FlowState.COLOCATED)
            stream = self._colocated()
        else:
            self._to(FlowState.RESERVING)
            stream = self._disaggregated()
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta

    def _generate_request(self, request_id: str, remote_prefill: bool) -> pb.DecodeGenerateRequest:
        return pb.DecodeGenerateRequest(
            request_id=request_id,
            prompt_token_ids=self.request.prompt_token_ids,
            sampling=sampling_message(self.request.sampling),
            output_token_ids=self._out.output_ids,
            remote_prefill=remote_prefill,
        )

    async def _open_stream(self, role: str, request_id: str, stack: contextlib.ExitStack):
        """Open Decode.Generate on the first pod of `role` that takes it.

        Returns (address, call, first message); the pod's load tracking and
        the call's cancellation are registered on `stack`. Pods that are full
        or unreachable are skipped (counted as retries of `role`); when none
        is left, ApiError 503 says why."""
        policy = self._deps.policy
        tried: set[str] = set(self._left_out)
        refusals: list[str] = []
        remote = role == "decode"
        num_prompt = len(self.request.prompt_token_ids)
        while True:
            try:
                if remote:
                    address = policy.choose_decode(
                        num_tokens=num_prompt + self.request.sampling.max_tokens,
                        exclude=frozenset(tried),
                    )
                else:
                    address = await policy.choose_colocated(
                        session_id=self.request.session_id,
                        prompt_token_ids=self.request.prompt_token_ids,
                        exclude=frozenset(tried),
                    )
            except NoPodAvailable as exc:
                reason = exc.reason + (f"; refused: {'; '.join(refusals)}" if refusals else "")
                raise ApiError(503, reason, code="no_pod_available") from None
            with contextlib.ExitStack() as candidate:
                candidate.enter_context(policy.track(address, num_tokens=num_prompt))
                call = self._deps.channels.decode(address).Generate(
                    self._generate_request(request_id, remote), timeout=self._remaining()
                )
                candidate.callback(call.cancel)  # no-op once the call has ended
                try:
                    first = await call.read()
                except grpc.aio.AioRpcError as error:
                    self._pod_failed(error, address)
                    refusals.append(f"{address} {describe(error)}")
                    self._deps.metrics.retries.labels(role=role).inc()
                    tried.add(address)
                    continue
                stack.enter_context(candidate.pop_all())
                return address, call, first

    async def _colocated(self) -> AsyncIterator[Delta]:
        with contextlib.ExitStack() as stack:
            request_id = self._next_request_id()
            address, call, first = await self._open_stream("colocated", request_id, stack)
            async with contextlib.aclosing(self._read_tokens(address, call, first)) as deltas:
                async for delta in deltas:
                    yield delta

    async def _disaggregated(self) -> AsyncIterator[Delta]:
        with contextlib.ExitStack() as stack:
            request_id = self._next_request_id()
            address, call, first = await self._open_stream("decode", request_id, stack)
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "reserved":
                raise AttemptFailed(f"decode pod {address} did not answer Reserved first",
                                    addresses=frozenset({address}), migrate=True)
            self._to(FlowState.PREFILLING)
            response = await self._prefill(request_id, first.reserved.target, address)
            self._out.set_cached_tokens(response.num_cached_tokens)
            first_logprobs = ()
            if response.HasField("first_logprob"):
                first_logprobs = logprobs_from_proto([response.first_logprob])
            delta = self._out.accept(self._out.next_index, [response.first_token_id],
                                     first_logprobs)
            self._to(FlowState.DECODING)
            if self._out.stopped:  # a stop string ended in the very first token
                call.cancel()
                self._deps.metrics.aborts.labels(reason="stop_string").inc()
                yield fold_final(delta, self._finish("stop"))
                return
            if delta is not None:
                yield delta  # the first token goes out before decode streams anything
            async with contextlib.aclosing(self._read_tokens(address, call, None)) as deltas:
                async for delta in deltas:
                    yield delta

    async def _prefill(self, request_id: str, target: pb.KVTarget, decode_address: str):
        """Prefill.Prefill against `target`, on up to 1 + max_prefill_retries pods.

        A prefill pod that is gone or broken (UNAVAILABLE, INTERNAL, UNKNOWN)
        or busy (RESOURCE_EXHAUSTED) is replaced by another against the same
        reservation: the decode pod's receiver treats a sender that went away
        mid-transfer as lost, not failed, and the new pod's BEGIN restarts the
        transfer from layer 0. Any other failure (ABORTED: the decode side
        refused or failed the transfer, DEADLINE_EXCEEDED from the pod, ...)
        means the reservation itself is gone, so the attempt ends and the
        request starts over on a new pair; only the broken pods are left out.
        """
        policy, metrics = self._deps.policy, self._deps.metrics
        request = pb.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=self.request.prompt_token_ids,
            sampling=sampling_message(self.request.sampling),
            output_token_ids=self._out.output_ids,
            target=target,
        )
        tried: set[str] = set(self._left_out)
        broken: set[str] = set()
        failures: list[str] = []
        for attempt in range(self._deps.settings.max_prefill_retries + 1):
            try:
                address = await policy.choose_prefill(
                    session_id=self.request.session_id,
                    prompt_token_ids=self.request.prompt_token_ids,
                    exclude=frozenset(tried),
                )
            except NoPodAvailable as exc:
                if not failures:
                    raise ApiError(503, exc.reason, code="no_pod_available") from None
                break
            if attempt:
                metrics.retries.labels(role="prefill").inc()
            with policy.track(address, num_tokens=len(request.prompt_token_ids)):
                call = self._deps.channels.prefill(address).Prefill(
                    request, timeout=self._remaining()
                )
                try:
                    return await call
                except grpc.aio.AioRpcError as error:
                    self._pod_failed(error, address)
                    failures.append(f"{address} {describe(error)}")
                    tried.add(address)
                    if error.code() in _BROKEN_POD:
                        broken.add(address)
                    elif error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        break
                finally:
                    call.cancel()  # no-op when done; frees the prefill pod when we leave early
        raise AttemptFailed(
            f"prefill failed on {len(failures)} pod(s) for decode pod {decode_address}: "
            + "; ".join(failures),
            addresses=frozenset(broken),
            migrate=False,
        )

    async def _read_tokens(self, address: str, call, first) -> AsyncIterator[Delta]:
        """Stream DecodeTokens from `call` into the assembler until a finish."""
        message = first
        while True:
            if message is None:
                try:
                    message = await call.read()
                except grpc.aio.AioRpcError as error:
                    self._pod_failed(error, address)
                    raise AttemptFailed(f"decode stream from {address} broke: {describe(error)}",
                                        addresses=frozenset({address}), migrate=True) from None
            if message is grpc.aio.EOF or message.WhichOneof("kind") != "tokens":
                raise AttemptFailed(f"decode stream from {address} ended without a finish",
                                    addresses=frozenset({address}), migrate=True)
            tokens, message = message.tokens, None
            if tokens.num_prompt_tokens:
                self._out.set_cached_tokens(tokens.num_cached_tokens)
            try:
                # most streams carry no logprobs: skip the per-message conversion then
                delta = self._out.accept(tokens.first_index, tokens.token_ids,
                                         logprobs_from_proto(tokens.logprobs)
                                         if tokens.logprobs else ())
            except OutputGap as gap:
                raise AttemptFailed(f"decode pod {address}: {gap}",
                                    addresses=frozenset({address}), migrate=True) from None
            if self._out.stopped:
                call.cancel()
                self._deps.metrics.aborts.labels(reason="stop_string").inc()
                yield fold_final(delta, self._finish("stop"))
                return
            if tokens.finish_reason == "abort":
                raise AttemptFailed(f"decode pod {address} aborted the request",
                                    addresses=frozenset({address}), migrate=True)
            if tokens.finish_reason:
                yield fold_final(delta, self._finish(tokens.finish_reason))
                return
            if delta is not None:
                yield delta

    def _finish(self, finish_reason: str) -> Delta:
        self._to(FlowState.FINISHED)
        return self._out.finish(finish_reason)

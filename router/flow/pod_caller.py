"""`PodCaller`: how one attempt calls pods, whatever its path.

`router.flow.request_flow.RequestFlow` makes one `PodCaller` per try, on the
router's event loop, chooses the try's path once and runs it over the
caller: `colocated_path`, `pd_path` (the P/D pair), `local_path` (a decode
pod that prefills the prompt itself) or `score_path` (a prefill pod scores
the prompt alone). What every path shares lives here: the time left, what a
pod's error means (`pod_failed`), the Decode.Generate request, opening a
stream on the first pod of a role that takes it (`open_stream`), reading
its tokens into the flow's `OutputAssembler` (`read_tokens`, with the
direct relay) and the final delta. State changes go to the flow's
`FlowState` through `to_state`.

Pods that are full or unreachable when a stream opens are skipped here
(counted as retries); a failure that another pod may not have ends the
attempt with `AttemptFailed`, and the flow decides what happens next. An
error the client must see (bad input, no pod, the deadline) is an
`ApiError`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

import grpc

from proto import pdserve_pb2 as pb
from router.api_error import ApiError
from router.decode_stream import StreamCall
from router.flow.deps import FlowDeps
from router.flow.direct_relay import DeltaSink
from router.flow.output import OutputAssembler, OutputGap, fold_final, logprobs_from_proto
from router.flow.pod_calls import AttemptFailed, client_error, describe
from router.flow.state import FlowState
from router.flow.tracing import FlowTrace
from router.generation import Delta, GenerationRequest
from router.routing.base import NoPodAvailable
from router.sampling import sampling_to_proto


class PodCaller:
    """One try of `request` under `request_id` (unique per attempt: the decode
    pod's ticket binds it, and a pod that still holds a failed attempt's
    state never confuses it with the next), as every path makes its pod
    calls. `left_out` are pods that failed this request already (`leave_out`
    adds one); `deadline` is the request's (time.monotonic). `sink`: the
    client's stream, for the direct relay (router.flow.direct_relay); None
    keeps every delta on the generators. `trace`: the flow's timeline and
    spans (router.flow.tracing; `note` what the pods are and say);
    `metadata`: the attempt's trace context, sent with every pod call.
    `prefill_address`: the prefill pod whose turn the attempt holds, once
    the P/D path has one (a split counts that pod's cached prefix)."""

    def __init__(
        self,
        request: GenerationRequest,
        request_id: str,
        *,
        deps: FlowDeps,
        out: OutputAssembler,
        left_out: frozenset[str],
        deadline: float,
        to_state: Callable[[FlowState], None],
        sink: DeltaSink | None = None,
        trace: FlowTrace | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.request = request
        self.trace = trace
        self.metadata = metadata or None
        self.sink = sink
        self.request_id = request_id
        self.deps = deps
        self.out = out
        self.left_out = left_out
        self.deadline = deadline
        self.to_state = to_state
        self.prefill_address = ""

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ApiError(
                504,
                "the request did not finish within --request-timeout "
                f"{self.deps.settings.request_timeout:g}s",
            )
        return left

    def pod_failed(self, error: grpc.aio.AioRpcError, address: str) -> None:
        """A pod call failed. Raise the client's error when it is one (bad input,
        the client's own deadline); otherwise mark an unreachable pod so routing
        skips it, and return: the caller retries or moves the request."""
        api_error = client_error(error, address, self.deps.settings.request_timeout)
        # A 504 with time left is the pod's own deadline: another pod may do it.
        if api_error is not None and not (api_error.status == 504
                                          and self.deadline - time.monotonic() > 1.0):
            raise api_error from None
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            self.deps.pool.mark_unhealthy(address, describe(error))

    def generate_request(self, remote_prefill: bool, address: str = "", below: int = 0,
                         beyond: int | None = None) -> pb.DecodeGenerateRequest:
        """The Decode.Generate request; with `remote_prefill` only, `below`:
        its local_prefill_below (`local_below`), `beyond`: its
        prefill_cached_tokens with local_within_budget (`prefill_cached`;
        None: off)."""
        return pb.DecodeGenerateRequest(
            request_id=self.request_id,
            prompt_token_ids=self.request.prompt_token_ids,
            sampling=self.sampling_proto(),
            output_token_ids=self.out.output_ids,
            remote_prefill=remote_prefill,
            local_prefill_below=below,
            split_at=self._split_at(address) if remote_prefill and not below else 0,
            local_within_budget=beyond is not None,
            prefill_cached_tokens=beyond or 0,
        )

    def prefill_cached(self) -> int | None:
        """What a reservation carries as prefill_cached_tokens: the prefix of
        the context the prefill pod chosen for it caches, as the router's
        index knows it (engine/local_rule.py); None when the rule is off."""
        rule = self.deps.local_prefill
        return None if rule is None else rule.prefill_cached_at(
            self.prefill_address, [*self.request.prompt_token_ids, *self.out.output_ids])

    def local_below(self, address: str) -> int:
        """What a reservation on decode pod `address` carries as
        local_prefill_below (router/routing/local_prefill.py; 0: off)."""
        rule = self.deps.local_prefill
        return 0 if rule is None else rule.below_at(
            address, len(self.request.prompt_token_ids) + self.request.sampling.max_tokens)

    def event(self, name: str, **details) -> None:
        """A request-level event on the timeline and the request span (a retry)."""
        if self.trace is not None:
            self.trace.event(name, **details)

    def note(self, **details) -> None:
        """Tell the attempt's timeline what its pods are or said (FlowTrace.note)."""
        if self.trace is not None:
            self.trace.note(**details)

    def leave_out(self, address: str) -> None:
        """`address` failed this attempt: the rest of it leaves the pod out."""
        self.left_out = self.left_out | {address}

    def _split_at(self, address: str) -> int:
        """The head's length if this request is split across the prefill pod
        and decode pod `address` (router/routing/split_prefill.py), else 0.
        Not a migrated request (its context has output), and not one that
        wants prompt logprobs."""
        rule = self.deps.split
        if (rule is None or self.out.output_ids
                or self.request.sampling.prompt_logprobs is not None):
            return 0
        return rule.split_at(address, self.request.prompt_token_ids, self.prefill_address)

    def sampling_proto(self) -> pb.SamplingParams:
        """The request's sampling for a pod; without prompt logprobs once an
        earlier pod reported them (a migrated request's next pod)."""
        sampling = sampling_to_proto(self.request.sampling)
        if self.out.has_prompt_logprobs:
            sampling.prompt_logprobs = 0
        return sampling

    def take_prompt_logprobs(self, entries) -> None:
        """A pod's prompt logprobs (TokenLogprob messages) into the output,
        when the request asked for them."""
        if self.request.sampling.prompt_logprobs is not None:
            self.out.set_prompt_logprobs(logprobs_from_proto(entries))

    async def open_stream(self, role: str, stack: contextlib.ExitStack):
        """Start the request on the first pod of `role` that takes it (on this
        router's Session to the pod, or Decode.Generate; PodChannels.open_generate).

        Returns (address, call, first message, whether a decode pod may have
        computed the prompt itself: a local rule was carried, `local_below`
        or `prefill_cached`); the pod's load tracking and
        the call's cancellation are registered on `stack`. Pods that are full
        or unreachable are skipped (counted as retries of `role`); when none
        is left, ApiError 503 says why. A colocated pod whose estimated wait
        is above --max-queue-wait is skipped too (router/routing/
        colocated_gate.py), and when every pod left was, ApiError 429."""
        policy = self.deps.policy
        tried: set[str] = set(self.left_out)
        refusals: list[str] = []
        remote = role == "decode"
        num_prompt = len(self.request.prompt_token_ids)
        # the limit binds a request before its first token only
        gate = None if remote or self.out.output_ids else self.deps.colocated_gate
        over: dict[str, float] = {}  # colocated pods skipped for their wait
        while True:
            try:
                if remote:
                    address = policy.choose_decode(
                        num_tokens=num_prompt + self.request.sampling.max_tokens,
                        exclude=frozenset(tried),
                        prompt_token_ids=self.request.prompt_token_ids,
                    )
                else:
                    address = await policy.choose_colocated(
                        session_id=self.request.session_id,
                        prompt_token_ids=self.request.prompt_token_ids,
                        exclude=frozenset(tried),
                    )
            except NoPodAvailable as exc:
                if over:
                    raise gate.overloaded(over, num_prompt) from None
                reason = exc.reason + (f"; refused: {'; '.join(refusals)}" if refusals else "")
                raise ApiError(503, reason, code="no_pod_available") from None
            if gate is not None and (wait := gate.over_limit(address, num_prompt)) is not None:
                over[address] = wait
                tried.add(address)
                continue
            with contextlib.ExitStack() as candidate:
                candidate.enter_context(policy.track(address, num_tokens=num_prompt))
                slot = None
                if gate is not None:
                    slot = gate.sent(address, num_prompt)
                    candidate.callback(slot.release)  # a no-op once the first token is in
                below = self.local_below(address) if remote else 0
                beyond = self.prefill_cached() if remote else None
                try:
                    call, first = await self.deps.channels.open_generate(
                        address, self.generate_request(remote, address, below, beyond),
                        self.remaining())
                except grpc.aio.AioRpcError as error:
                    self.pod_failed(error, address)
                    refusals.append(f"{address} {describe(error)}")
                    self.deps.metrics.retries.labels(role=role).inc()
                    self.event("retry", role=role, pod=address, reason=describe(error))
                    tried.add(address)
                    continue
                if slot is not None and first is not grpc.aio.EOF:
                    slot.release(_computed(first, num_prompt))
                candidate.callback(call.cancel)  # no-op once the request has ended
                stack.enter_context(candidate.pop_all())
                self.note(**{role: address})
                return address, call, first, bool(below) or beyond is not None

    async def read_tokens(self, address: str, call, first) -> AsyncIterator[Delta]:
        """Stream DecodeTokens from `call` (a StreamCall, or a Decode.Generate
        call: both give messages whose `kind` is "tokens") into the assembler
        until a finish. After the first delta, a StreamCall's plain tokens
        may go to the client by the direct relay instead (`_relay_direct`)."""
        message = first
        relaying = False
        try:
            while True:
                if message is None:
                    try:
                        message = await call.read()
                    except grpc.aio.AioRpcError as error:
                        self.pod_failed(error, address)
                        raise AttemptFailed(
                            f"decode stream from {address} broke: {describe(error)}",
                            addresses=frozenset({address}), migrate=True) from None
                if message is grpc.aio.EOF or message.WhichOneof("kind") != "tokens":
                    raise AttemptFailed(f"decode stream from {address} ended without a finish",
                                        addresses=frozenset({address}), migrate=True)
                tokens, message = message.tokens, None
                if tokens.num_prompt_tokens:
                    self.out.set_cached_tokens(tokens.num_cached_tokens)
                if tokens.prompt_logprobs:
                    self.take_prompt_logprobs(tokens.prompt_logprobs)
                try:
                    # most streams carry no logprobs: skip the per-message conversion then
                    delta = self.out.accept(tokens.first_index, tokens.token_ids,
                                             logprobs_from_proto(tokens.logprobs)
                                             if tokens.logprobs else ())
                except OutputGap as gap:
                    raise AttemptFailed(f"decode pod {address}: {gap}",
                                        addresses=frozenset({address}), migrate=True) from None
                if self.out.stopped:
                    call.cancel()
                    self.deps.metrics.aborts.labels(reason="stop_string").inc()
                    yield fold_final(delta, self.finish("stop"))
                    return
                if tokens.finish_reason == "abort":
                    raise AttemptFailed(f"decode pod {address} aborted the request",
                                        addresses=frozenset({address}), migrate=True)
                if tokens.finish_reason:
                    yield fold_final(delta, self.finish(tokens.finish_reason))
                    return
                if delta is not None:
                    yield delta
                    # the client has it: from here on the reader may write plain deltas
                    if not relaying:
                        relaying = self._start_direct_relay(call)
        finally:
            if relaying:
                call.relay = None

    def _start_direct_relay(self, call) -> bool:
        """Give `call` the relay callback (router.flow.direct_relay): only a
        StreamCall, only with a client sink, and only for plain text: not
        with stop strings (the task ends the request on a match), logprobs
        or prompt logprobs (their deltas carry more than text)."""
        sampling = self.request.sampling
        if (self.sink is None or not isinstance(call, StreamCall) or not self.out.plain
                or sampling.logprobs is not None or sampling.prompt_logprobs is not None):
            return False
        call.relay = self._relay_direct
        return True

    def _relay_direct(self, tokens: pb.DecodeTokens) -> int | None:
        """The relay callback, called by the session's reader while this
        request's task waits in `read()`: the number of `tokens` (no finish
        reason) written to the client here, or None to leave them to the task.

        Runs once per token per stream, so it reads as little as it can:
        `_start_direct_relay` ruled out what makes a delta more than text,
        and the output stays plain (only a request that asked for prompt
        logprobs gets them)."""
        out, sink = self.out, self.sink
        # a repeat or a gap (a pod after a migration) is the task's to sort out
        if tokens.first_index != len(out.output_ids) or not sink.ready():
            return None
        if out.cached_tokens is None and tokens.num_prompt_tokens:
            out.set_cached_tokens(tokens.num_cached_tokens)
        token_ids = tokens.token_ids
        count = len(token_ids)
        if count:
            sink.send_text(out.accept_text(token_ids), token_ids)
        return count

    def finish(self, finish_reason: str) -> Delta:
        self.to_state(FlowState.FINISHED)
        return self.out.finish(finish_reason)


def _computed(first: pb.DecodeGenerateResponse | pb.SessionEvent, num_prompt: int) -> int:
    """Prompt tokens a colocated pod computed before its `first` message
    (Decode.Generate's or the Session's): the prompt less the cache hit it
    reports (at least one)."""
    if first.WhichOneof("kind") == "tokens" and first.tokens.num_prompt_tokens:
        tokens = first.tokens
        return max(1, tokens.num_prompt_tokens - tokens.num_cached_tokens)
    return max(1, num_prompt)

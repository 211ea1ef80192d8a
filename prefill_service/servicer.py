"""`PrefillServicer`: the prefill pod's `pdserve.v1.Prefill` service.

Life cycle of one `Prefill` RPC (request R), all on the pod's event loop
except where the engine loop thread is named:

    RPC arrives ── draining? ──> UNAVAILABLE
        │ validate (ids, lengths, sampling, target)  ── bad ──> INVALID_ARGUMENT
        v
    export.register(R, target)          (skipped when target has no endpoints:
        │                                prefill only, no transfer - the TTFT baseline)
        v
    engine_loop.add_request(R, prefill_only=True)
        │   WAITING  (engine queue)
        │   RUNNING  engine loop thread: each step computes a chunk; after every
        │            layer the KVExport hook extracts the span and queues it on
        │            the sender, so layer l is on the wire while l+1 computes
        v
    first token sampled -> FINISHED_PREFILL_DONE, output on R's stream
        v
    export.finish(R, first_token) -> END queued after the last DATA frame
        v
    yield PrefillResponse(first_token: token, logprob, num_cached_tokens)
        │   at once: the router sends the token to its client before the
        │   transfer is decided
        │   await the decode pod's verdict
        v
    yield PrefillResponse(transfer_done: kv bytes), the stream ends OK
        or the stream ends ABORTED "KV transfer to <endpoints> failed: <reason>"
        (after the first token: the router moves R on with that token as output)

A target whose `num_held_tokens` is n > 0 (the decode pod's prefix cache
holds the first n context tokens) gets only tokens [n, context): the layout
starts at that token offset, and `kv_bytes_sent` and
`pdserve_kv_transfer_bytes_total` count what was sent.

With tensor parallelism on either side (this pod at TP=a > 1, or a target
listing a decode pod's ranks) every prefill rank sends its own KV heads to
the decode ranks holding them (prefill_service/kv_export.py on rank 0,
rank_export.py on the workers): the verdict is every part's (the first
failure wins), and the byte counts are all ranks' together.

Without a target (prefill only, the TTFT baseline) `transfer_done` (0 bytes)
follows the first token at once. A max_tokens=0 request (scoring the prompt:
its `prompt_logprobs`, no token) takes no target; its `first_token` has
`scored_only` set and carries the prompt logprobs. A failure before the first token ends the
stream with its status and no message.

Cancel at any point (the router cancels the RPC, or calls `Abort`):
engine abort (frees R's blocks), export abort (ABORT frame to the decode pod),
and the RPC ends CANCELLED (client cancel) or ABORTED (Abort RPC).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc

from engine.engine_loop import EngineLoop, RequestAborted, RequestStream
from engine.metrics import PodMetrics
from engine.outputs import RequestOutput
from kv_transfer.base import KVLayout, TransferOutcome, TransferTarget
from kv_transfer.errors import reason_code
from kv_transfer.target_wire import target_from_proto
from pod.drain import DrainGate
from pod.errors import pod_errors
from pod.kv_shape import KVShape
from pod.load import load_report, watch_load
from pod.messages import ModelLimits, check_request, logprob_to_proto
from prefill_service.kv_export import KVExport
from prefill_service.rank_sends import bytes_moved
from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.roles import PodRole
from proto.status import ServiceError
from telemetry.pod_trace import PodTrace, finished_with

log = logging.getLogger(__name__)


class PrefillServicer(pdserve_pb2_grpc.PrefillServicer):
    """Thin servicer over the engine loop and the KV export hook."""

    def __init__(self, *, loop: EngineLoop, export: KVExport, metrics: PodMetrics,
                 gate: DrainGate, limits: ModelLimits, kv_shape: KVShape, model: str,
                 generation: int, cache_events_channel: str = "") -> None:
        self._loop = loop
        self._export = export
        self._metrics = metrics
        self._gate = gate
        self._limits = limits
        self._kv_shape = kv_shape
        self._model = model
        self._generation = generation
        self._cache_events_channel = cache_events_channel

    @pod_errors
    async def Prefill(self, request: pdserve_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pdserve_pb2.PrefillResponse]:
        trace = PodTrace("prefill.request", context.invocation_metadata(),
                         request_id=request.request_id,
                         prompt_tokens=len(request.prompt_token_ids))
        async for message in finished_with(trace, self._admitted(request, trace)):
            yield message

    async def _admitted(self, request: pdserve_pb2.PrefillRequest, trace: PodTrace
                        ) -> AsyncIterator[pdserve_pb2.PrefillResponse]:
        with self._gate.admit():  # a refusal here ends the trace with its error too
            async for message in self._prefill(request, trace):
                yield message

    async def _prefill(self, request: pdserve_pb2.PrefillRequest, trace: PodTrace
                       ) -> AsyncIterator[pdserve_pb2.PrefillResponse]:
        arrived = trace.started
        checked = check_request(request, self._limits)
        rid, params = checked.request_id, checked.params
        prompt, outputs = checked.prompt_token_ids, checked.output_token_ids
        target = target_from_proto(request.target) if request.target.endpoints else None
        if target is not None and trace.traceparent:  # BEGIN carries it to the decode pod
            target = dataclasses.replace(target, traceparent=trace.traceparent)
        if target is not None and params.max_tokens == 0:
            raise ValueError("max_tokens 0 (scoring the prompt) ends after prefill: it takes "
                             "no KV target")
        layout = self._transfer_layout(len(prompt) + len(outputs), request.target.num_held_tokens)
        if target is not None:
            self._export.register(rid, target, layout)
        finished = settled = False
        try:
            stream = await self._loop.add_request(rid, prompt, params, output_token_ids=outputs,
                                                  prefill_only=True)
            first = await _first_output(stream)
            finished = True
            first_at = time.monotonic()
            self._metrics.time_to_first_token.observe(first_at - arrived)
            # the queue ends where a step first computed it (the engine's stamp)
            computing = first.first_scheduled_at or arrived
            trace.phase("prefill.queue_wait", arrived, max(arrived, computing))
            trace.phase("prefill.compute", max(arrived, computing), first_at,
                        cached_tokens=first.num_cached_tokens,
                        computed_tokens=first.num_prompt_tokens - first.num_cached_tokens,
                        preemptions=first.num_preemptions)
            first_message = pdserve_pb2.PrefillResponse(request_id=rid,
                                                        first_token=_first_token(first))
            sent = 0
            if target is None:
                yield first_message
            else:
                # END goes on the wire before the first token goes to the router
                started = time.monotonic()
                verdict = asyncio.wrap_future(self._export.finish(rid, first.new_token_ids[0]))
                yield first_message
                try:
                    sent = await self._await_verdict(rid, target, layout, started, verdict)
                finally:
                    trace.phase("kv.send", started, bytes=sent, transport=target.transport,
                                to=",".join(target.endpoints))
            self._metrics.e2e_request_latency.observe(time.monotonic() - arrived)
            settled = True
            yield pdserve_pb2.PrefillResponse(
                request_id=rid, transfer_done=pdserve_pb2.PrefillTransferDone(kv_bytes_sent=sent))
        except RequestAborted as exc:
            self._export.abort(rid, f"request aborted ({exc.reason})")
            raise ServiceError(grpc.StatusCode.ABORTED,
                               f"request {rid} was aborted ({exc.reason})") from None
        except (asyncio.CancelledError, GeneratorExit):
            if settled:  # the stream was closed after its last message: nothing to free
                raise
            # The router cancelled the RPC: free the engine's blocks, tell D.
            self._export.abort(rid, "prefill RPC cancelled")
            if not finished:
                await asyncio.shield(self._loop.abort(rid, "client"))
            else:
                self._metrics.abort("client")
            raise
        finally:
            self._export.forget(rid)

    def _transfer_layout(self, num_context: int, num_held: int) -> KVLayout:
        """The tokens to send: all context tokens after the `num_held` the decode
        pod already holds (cache-miss-only transfer)."""
        if not 0 <= num_held < num_context:
            raise ValueError(f"target.num_held_tokens {num_held} must be in [0, {num_context}): "
                             f"the decode pod must be sent at least one of the {num_context} "
                             f"context tokens")
        return self._kv_shape.layout(num_context - num_held, num_held)

    async def _await_verdict(self, rid: str, target: TransferTarget, layout: KVLayout,
                             started: float, verdict: asyncio.Future[TransferOutcome]) -> int:
        """The decode pod's verdict on R's KV: the bytes sent, or ABORTED with the reason."""
        outcome = await verdict
        if not outcome.ok:
            self._metrics.transfer_failure(reason_code(outcome.reason))
            raise ServiceError(
                grpc.StatusCode.ABORTED,
                f"KV transfer of {rid} to {','.join(target.endpoints)} failed: {outcome.reason}",
            )
        self._metrics.kv_transfer_seconds.observe(time.monotonic() - started)
        sent = bytes_moved(layout, target)  # all ranks' (a replicating decode pod gets more)
        self._metrics.kv_transfer_bytes.inc(sent)
        return sent

    @pod_errors
    async def Abort(self, request: pdserve_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pdserve_pb2.AbortResponse:
        reason = request.reason or "aborted by caller"
        self._export.abort(request.request_id, reason)
        found = await self._loop.abort(request.request_id, "abort_rpc")
        return pdserve_pb2.AbortResponse(found=found)

    @pod_errors
    async def GetLoad(self, request: pdserve_pb2.LoadRequest,
                      context: grpc.aio.ServicerContext) -> pdserve_pb2.LoadReport:
        return load_report(PodRole.PREFILL, self._model, self._generation, self._loop, self._gate,
                           self._cache_events_channel)

    async def WatchLoad(self, request: pdserve_pb2.WatchLoadRequest,
                        context: grpc.aio.ServicerContext):
        """GetLoad's report pushed on change, with heartbeats (pod/load.py)."""
        async for report in watch_load(
                lambda: load_report(PodRole.PREFILL, self._model, self._generation, self._loop,
                                    self._gate, self._cache_events_channel),
                self._loop, self._gate, request):
            yield report


def _first_token(first: RequestOutput) -> pdserve_pb2.PrefillFirstToken:
    """The first token, or (max_tokens 0) the scored prompt's finish without one."""
    return pdserve_pb2.PrefillFirstToken(
        token_id=first.new_token_ids[0] if first.new_token_ids else 0,
        logprob=logprob_to_proto(first.new_logprobs[0]) if first.new_logprobs else None,
        num_prompt_tokens=first.num_prompt_tokens,
        num_cached_tokens=first.num_cached_tokens,
        prompt_logprobs=[logprob_to_proto(lp) for lp in first.prompt_logprobs or ()],
        scored_only=not first.new_token_ids,
    )


async def _first_output(stream: RequestStream) -> RequestOutput:
    """The output carrying the first sampled token (prefill_only requests
    finish with it; the engine may still send it in the finishing output)."""
    async for output in stream:
        if output.new_token_ids or (output.finish_reason == "length"
                                    and output.num_output_tokens == 0):
            return output  # a token, or a max_tokens=0 request's scored prompt
        if output.finished:
            raise ServiceError(grpc.StatusCode.INTERNAL,
                               f"request {output.request_id} finished "
                               f"({output.finish_reason}) without a first token")
    raise ServiceError(grpc.StatusCode.INTERNAL, "request stream ended without output")

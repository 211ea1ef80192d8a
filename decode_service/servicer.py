"""`DecodeServicer`: the `pdserve.v1.Decode` service of decode and colocated pods.

`Session` carries many requests over one stream (one per router process):
each `generate` command runs the same per-request generator as `Generate`
(pod/decode_stream.py), its `cancel` command is a Generate stream's cancel,
and the pod answers with one `SessionBatch` per engine step.

Life cycle of one `Generate` stream (request R) with `remote_prefill=true`
(decode pod), on the pod's event loop; the import itself (engine loop,
receiver, injector) is a `KVImport` (decode_service/kv_import.py):

    RPC ── draining? ──> UNAVAILABLE;  bad ids/lengths/sampling ──> INVALID_ARGUMENT
      v
    kv.reserve()        WAITING_FOR_REMOTE_KV: blocks for context + max_tokens held
      │  no room ──> RESOURCE_EXHAUSTED  (the router tries another pod)
      v
    kv.open()           injector expects R; landing buffer + ticket (at TP > 1
      │                 every rank's, kv.ranks_expecting(): decode_service/kv_import.py)
      │  landing pool full ──> RESOURCE_EXHAUSTED (blocks released first)
      v
    yield Reserved{target, block_size, num_reserved_blocks}
      v
    kv.wait()           WAITING_FOR_KV: receiver threads land each layer; the
      │  injector thread writes it into R's slots while the engine keeps stepping,
      │  and after the last layer and END queues R's commit on the engine loop
      │  itself (R joins the next step; no hop through this event loop)
      │  transfer failed ──> ABORTED "<reason>";  deadline ──> DEADLINE_EXCEEDED
      v
    kv.commit()         landing freed, the queued commit awaited: RUNNING in the batch
      v
    yield DecodeTokens(first_index=1..), the last one with finish_reason

With `remote_prefill=false` (colocated pod, or a decode pod asked to compute
locally): add_request -> WAITING -> RUNNING -> tokens from index 0. The same
happens with `remote_prefill=true` when a conditional-disaggregation rule
holds (`local_prefill_below`, or `local_within_budget`: the pod's cached
prefix is longer than the prefill path's and the rest fits its inter-token
budget; engine/local_rule.py, decided in `kv.reserve()`): no Reserved,
tokens from index 0.
With the prefix cache on, Reserved's `target.num_held_tokens` says how much
of the context the pod already holds; the prefill pod sends only the rest.

Cancel (client goes away, or `Abort`) in any state: before commit
`kv.free()` cancels the transfer at the receiver and lets the injector forget
R *before* the engine frees R's blocks, so no writer can touch blocks that
another request may get next; after commit the engine aborts R. Landing
buffers are released in every path. `Abort` of an R still importing only
fails its `kv.wait()` (`KVImport.abort`); R's own coroutine frees it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from decode_service.injector import TransferFailed
from decode_service.kv_import import KVImport, RemoteKV
from decode_service.messages import tokens_message
from engine.engine_loop import EngineLoop
from engine.metrics import PodMetrics
from engine.request_stream import EngineDead, RequestAborted, RequestStream
from engine.sampling_params import SamplingParams
from kv_transfer.errors import BufferPoolExhausted, reason_code
from kv_transfer.target_wire import target_to_proto
from pod.decode_stream import DecodeStreamMux
from pod.drain import DrainGate
from pod.errors import pod_errors
from pod.load import load_report, watch_load
from pod.messages import ModelLimits, check_request
from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.status import ServiceError
from telemetry import kv_traces
from telemetry.pod_trace import PodTrace, finished_with

log = logging.getLogger(__name__)

# A full landing pool is "no room now", like a full block pool.
decode_errors = pod_errors.extended(((BufferPoolExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),))


class DecodeServicer(pdserve_pb2_grpc.DecodeServicer):
    """Thin servicer over the engine loop (and, on a decode pod, one `KVImport`
    per remote-prefilled request)."""

    def __init__(self, *, role: str, loop: EngineLoop, metrics: PodMetrics, gate: DrainGate,
                 limits: ModelLimits, model: str, generation: int,
                 remote: RemoteKV | None, cache_events_channel: str = "") -> None:
        self._role = role
        self._loop = loop
        self._metrics = metrics
        self._gate = gate
        self._limits = limits
        self._model = model
        self._generation = generation
        self._cache_events_channel = cache_events_channel
        self._remote = remote
        # R -> its import, from open until commit or free (Abort fails its wait)
        self._importing: dict[str, KVImport] = {}

    @decode_errors
    async def Generate(self, request: pdserve_pb2.DecodeGenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pdserve_pb2.DecodeGenerateResponse]:
        async for message in self._generate(request, context.invocation_metadata()):
            yield message

    @decode_errors
    async def Session(self, request_iterator: AsyncIterator[pdserve_pb2.SessionCommand],
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pdserve_pb2.SessionBatch]:
        """Many requests over one stream, one batch per engine step
        (pod/decode_stream.py); each request lives exactly as a `Generate`
        stream would."""
        async for batch in DecodeStreamMux(self._generate, decode_errors).run(request_iterator):
            yield batch

    async def _generate(self, request: pdserve_pb2.DecodeGenerateRequest, metadata=None
                        ) -> AsyncIterator[pdserve_pb2.DecodeGenerateResponse]:
        # the request's spans (telemetry/pod_trace.py): made at its end, when traced
        trace = PodTrace("decode.request", metadata, request_id=request.request_id,
                         remote_prefill=request.remote_prefill)
        async for message in finished_with(trace, self._generate_traced(request, trace)):
            yield message

    async def _generate_traced(self, request: pdserve_pb2.DecodeGenerateRequest,
                               trace: PodTrace
                               ) -> AsyncIterator[pdserve_pb2.DecodeGenerateResponse]:
        with self._gate.admit():
            arrived = trace.started
            checked = check_request(request, self._limits)
            params = checked.params
            prompt, outputs = checked.prompt_token_ids, checked.output_token_ids
            _check_split(request, len(prompt) + len(outputs), params)
            if request.remote_prefill:
                if self._remote is None:
                    raise ValueError("remote_prefill=true needs a decode pod; this "
                                     f"{self._role} pod computes prompts locally")
                beyond = (request.prefill_cached_tokens if request.local_within_budget
                          else None)
                messages = self._generate_remote(request.request_id, prompt, outputs, params,
                                                 arrived, request.local_prefill_below,
                                                 request.split_at, trace, beyond)
            else:
                messages = self._generate_local(request.request_id, prompt, outputs, params,
                                                arrived, trace)
            async for message in messages:
                yield message

    async def _generate_local(self, rid: str, prompt: list[int], outputs: list[int],
                              params: SamplingParams, arrived: float, trace: PodTrace
                              ) -> AsyncIterator[pdserve_pb2.DecodeGenerateResponse]:
        stream = await self._loop.add_request(rid, prompt, params, output_token_ids=outputs)
        async for message in self._stream_tokens(rid, stream, len(outputs), arrived,
                                                 trace=trace):
            yield message

    async def _stream_tokens(self, rid: str, stream: RequestStream, first_index: int,
                             arrived: float, first_token_at: float | None = None,
                             trace: PodTrace | None = None,
                             ) -> AsyncIterator[pdserve_pb2.DecodeGenerateResponse]:
        """Relay R's outputs; on cancel, abort R in the engine (frees its blocks).
        `first_token_at`: when a remote R's first token (from the prefill pod)
        was committed; later gaps count as inter-token latency. `trace` gets
        the wait for the first step and the generation as phases."""
        index, last = first_index, first_token_at
        waiting_since = time.monotonic() if first_token_at is None else first_token_at
        first_step: float | None = None  # once per request, not per token
        preemptions = 0
        finished = False
        try:
            async for output in stream:
                now = time.monotonic()
                if output.new_token_ids:
                    if first_step is None:
                        first_step = now
                    if last is None:
                        self._metrics.time_to_first_token.observe(now - arrived)
                    else:
                        self._metrics.inter_token_latency.observe(now - last)
                    last = now
                finished = output.finished
                preemptions = output.num_preemptions
                if output.new_token_ids or output.finished:
                    yield tokens_message(output, index)
                index += len(output.new_token_ids)
            self._metrics.e2e_request_latency.observe(time.monotonic() - arrived)
        except RequestAborted:
            finished = True
            yield pdserve_pb2.DecodeGenerateResponse(
                tokens=pdserve_pb2.DecodeTokens(first_index=index, finish_reason="abort"))
        except EngineDead as exc:
            finished = True  # nothing left to abort
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"request {rid} lost: {exc}; retry on another pod") from None
        finally:
            if trace is not None and first_step is not None:
                trace.phase("decode.first_step_wait", waiting_since, first_step)
                trace.phase("decode.generate", first_step, tokens=index - first_index,
                            preemptions=preemptions)
            if not finished:
                # Client cancel (CancelledError / generator closed) mid-stream.
                await asyncio.shield(self._loop.abort(rid, "client"))

    async def _generate_remote(self, rid: str, prompt: list[int], outputs: list[int],
                               params: SamplingParams, arrived: float,
                               local_prefill_below: int = 0, split_at: int = 0,
                               trace: PodTrace | None = None,
                               prefill_cached_tokens: int | None = None,
                               ) -> AsyncIterator[pdserve_pb2.DecodeGenerateResponse]:
        remote = self._remote
        assert remote is not None
        kv = KVImport(rid, self._loop, remote)
        outcome = "client"  # how R ends if it never reaches commit
        try:
            reservation = await kv.reserve(prompt, params, outputs, local_prefill_below,
                                           prefill_cached_tokens)
            if reservation is None:  # computed here (KVImport LOCAL, engine/local_rule.py)
                async for message in self._stream_tokens(rid, kv.stream, len(outputs), arrived,
                                                         trace=trace):
                    yield message
                return
            split_at = kv.split_for(split_at)
            target = kv.open(split_at)
            self._importing[rid] = kv
            await kv.ranks_expecting()  # TP > 1: every decode rank knows R first
            yield pdserve_pb2.DecodeGenerateResponse(reserved=pdserve_pb2.Reserved(
                target=target_to_proto(target, reservation.num_held_tokens),
                block_size=reservation.block_size,
                num_reserved_blocks=len(reservation.block_ids), split_at=split_at))
            reserved_at = time.monotonic()
            try:
                await kv.wait()  # the injector thread queued R's commit already
            except TransferFailed as exc:
                _trace_receive(trace, rid, reserved_at, kv.held_bytes, exc.reason)
                raise
            _trace_receive(trace, rid, reserved_at, kv.held_bytes)
            # Reserved -> every layer injected and END accepted, as this pod saw it
            self._metrics.kv_transfer_seconds.observe(time.monotonic() - reserved_at)
            self._metrics.kv_transfer_saved_bytes.inc(kv.held_bytes)
            stream = await kv.commit()
            first_token_at = None
            if not split_at:  # a split's token 0 is this pod's, observed as it streams
                first_token_at = time.monotonic()
                self._metrics.time_to_first_token.observe(first_token_at - arrived)
        except (TransferFailed, RequestAborted, ServiceError) as exc:
            outcome = "abort_rpc" if isinstance(exc, RequestAborted) else "transfer"
            raise self._transfer_error(rid, exc, remote) from None
        finally:
            kv_traces.take(rid)  # cancelled before its span: its record goes too
            if self._importing.get(rid) is kv:
                del self._importing[rid]
            if kv.holds_resources:
                await asyncio.shield(kv.free(outcome))
        first_index = len(outputs) + (0 if split_at else 1)
        async for message in self._stream_tokens(rid, stream, first_index, arrived,
                                                 first_token_at, trace):
            yield message

    def _transfer_error(self, rid: str, exc: Exception, remote: RemoteKV) -> ServiceError:
        if isinstance(exc, ServiceError):
            return exc
        if isinstance(exc, RequestAborted):
            return ServiceError(grpc.StatusCode.ABORTED,
                                f"request {rid} was aborted while waiting for its KV "
                                f"({exc.reason})")
        assert isinstance(exc, TransferFailed)
        code = reason_code(exc.reason)
        self._metrics.transfer_failure(code)
        if code == "deadline":
            return ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"KV for request {rid} did not arrive in time "
                                f"({exc.reason}); its blocks were freed")
        return ServiceError(grpc.StatusCode.ABORTED,
                            f"KV transfer for request {rid} failed: {exc.reason}")

    @decode_errors
    async def Abort(self, request: pdserve_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pdserve_pb2.AbortResponse:
        rid = request.request_id
        reason = request.reason or "aborted by caller"
        kv = self._importing.get(rid)
        if kv is not None:
            # R's blocks may still be written by the injector: let its
            # Generate coroutine free them in order (see KVImport.free).
            kv.abort(reason)
            return pdserve_pb2.AbortResponse(found=True)
        found = await self._loop.abort(rid, "abort_rpc")
        return pdserve_pb2.AbortResponse(found=found)

    @decode_errors
    async def GetLoad(self, request: pdserve_pb2.LoadRequest,
                      context: grpc.aio.ServicerContext) -> pdserve_pb2.LoadReport:
        return load_report(self._role, self._model, self._generation, self._loop, self._gate,
                           self._cache_events_channel)

    async def WatchLoad(self, request: pdserve_pb2.WatchLoadRequest,
                        context: grpc.aio.ServicerContext):
        """GetLoad's report pushed on change, with heartbeats (pod/load.py)."""
        async for report in watch_load(
                lambda: load_report(self._role, self._model, self._generation, self._loop,
                                    self._gate, self._cache_events_channel),
                self._loop, self._gate, request):
            yield report


def _trace_receive(trace: PodTrace | None, rid: str, reserved_at: float, held_bytes: int,
                   error: str | None = None) -> None:
    """R's `kv.receive_inject` phase, Reserved until its KV is in (or the
    transfer failed, `error`), with what its sampled BEGIN's record saw
    (telemetry.kv_traces): `kv.layer` and `kv.checksum_failure` events; its
    traceparent is the call's parent over a Session stream."""
    if trace is None:
        return
    traced = kv_traces.take(rid)
    if traced is not None:
        trace.adopt(traced.traceparent)
    trace.phase("kv.receive_inject", reserved_at, saved_bytes=held_bytes, error=error,
                events=traced.events() if traced is not None else ())


def _check_split(request: pdserve_pb2.DecodeGenerateRequest, num_context: int,
                 params: SamplingParams) -> None:
    """ValueError (INVALID_ARGUMENT) naming what a split prefill cannot do."""
    split_at = request.split_at
    if not split_at:
        return
    if split_at < 0 or split_at >= num_context:
        raise ValueError(f"split_at {split_at} must be in [1, {num_context}): the head is part "
                         f"of the {num_context}-token context and the tail at least its last "
                         "token")
    if not request.remote_prefill or request.local_prefill_below:
        raise ValueError("split_at needs remote_prefill=true and no local_prefill_below")
    if params.prompt_logprobs is not None:
        raise ValueError("split_at with prompt_logprobs: the prefill pod computes only the "
                         "head, so no pod has every prompt position's logits")

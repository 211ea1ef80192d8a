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
        │   await the decode pod's verdict
        v
    PrefillResponse(first token, logprob, num_cached_tokens, kv bytes)
        or ABORTED "KV transfer to <endpoints> failed: <reason>"

Cancel at any point (the router cancels the RPC, or calls `Abort`):
engine abort (frees R's blocks), export abort (ABORT frame to the decode pod),
and the RPC ends CANCELLED (client cancel) or ABORTED (Abort RPC).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from engine.engine_loop import EngineDead, EngineLoop, RequestAborted, RequestStream
from engine.metrics import PodMetrics
from engine.outputs import RequestOutput
from kv_transfer.base import KVLayout, TransferTarget
from kv_transfer.errors import reason_code
from prefill_service.kv_export import KVExport
from prefill_service.messages import (
    ModelLimits,
    check_context,
    check_request_id,
    logprob_to_proto,
    sampling_from_proto,
)
from prefill_service.pod import DrainGate, load_report
from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.status import ServiceError, grpc_errors, register_status

log = logging.getLogger(__name__)

# A pod whose engine loop stopped cannot serve: the caller should go elsewhere.
register_status(EngineDead, grpc.StatusCode.UNAVAILABLE)


@dataclass(frozen=True, slots=True)
class KVShape:
    """Per-token KV shape of the served model: what a `KVLayout` needs besides the length."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def layout(self, num_tokens: int) -> KVLayout:
        return KVLayout(self.num_layers, num_tokens, self.num_kv_heads, self.head_dim, self.dtype)


def target_from_proto(msg: pdserve_pb2.KVTarget) -> TransferTarget:
    """ValueError (from TransferTarget) names whatever field is malformed."""
    return TransferTarget(
        endpoints=tuple(msg.endpoints), ticket=bytes(msg.ticket), transport=msg.transport or "tcp",
        generation=msg.generation, deadline=msg.deadline_unix_ms / 1000.0,
    )


class PrefillServicer(pdserve_pb2_grpc.PrefillServicer):
    """Thin servicer over the engine loop and the KV export hook."""

    def __init__(self, *, loop: EngineLoop, export: KVExport, metrics: PodMetrics,
                 gate: DrainGate, limits: ModelLimits, kv_shape: KVShape, model: str,
                 generation: int) -> None:
        self._loop = loop
        self._export = export
        self._metrics = metrics
        self._gate = gate
        self._limits = limits
        self._kv_shape = kv_shape
        self._model = model
        self._generation = generation

    @grpc_errors
    async def Prefill(self, request: pdserve_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> pdserve_pb2.PrefillResponse:
        with self._gate.admit():
            return await self._prefill(request)

    async def _prefill(self, request: pdserve_pb2.PrefillRequest) -> pdserve_pb2.PrefillResponse:
        arrived = time.monotonic()
        rid = request.request_id
        check_request_id(rid)
        params = sampling_from_proto(request.sampling)
        prompt, outputs = list(request.prompt_token_ids), list(request.output_token_ids)
        check_context(prompt, outputs, params, self._limits)
        target = target_from_proto(request.target) if request.target.endpoints else None
        layout = self._kv_shape.layout(len(prompt) + len(outputs))
        if target is not None:
            self._export.register(rid, target, layout)
        finished = False
        try:
            stream = await self._loop.add_request(rid, prompt, params, output_token_ids=outputs,
                                                  prefill_only=True)
            first = await _first_output(stream)
            finished = True
            self._metrics.time_to_first_token.observe(time.monotonic() - arrived)
            sent = 0
            if target is not None:
                sent = await self._finish_transfer(rid, target, layout, first)
            self._metrics.e2e_request_latency.observe(time.monotonic() - arrived)
            return pdserve_pb2.PrefillResponse(
                request_id=rid,
                first_token_id=first.new_token_ids[0],
                first_logprob=(logprob_to_proto(first.new_logprobs[0])
                               if first.new_logprobs else None),
                num_prompt_tokens=first.num_prompt_tokens,
                num_cached_tokens=first.num_cached_tokens,
                kv_bytes_sent=sent,
            )
        except RequestAborted as exc:
            self._export.abort(rid, f"request aborted ({exc.reason})")
            raise ServiceError(grpc.StatusCode.ABORTED,
                               f"request {rid} was aborted ({exc.reason})") from None
        except asyncio.CancelledError:
            # The router cancelled the RPC: free the engine's blocks, tell D.
            self._export.abort(rid, "prefill RPC cancelled")
            if not finished:
                await asyncio.shield(self._loop.abort(rid, "client"))
            else:
                self._metrics.abort("client")
            raise
        finally:
            self._export.forget(rid)

    async def _finish_transfer(self, rid: str, target: TransferTarget, layout: KVLayout,
                               first: RequestOutput) -> int:
        started = time.monotonic()
        outcome = await asyncio.wrap_future(self._export.finish(rid, first.new_token_ids[0]))
        if not outcome.ok:
            self._metrics.transfer_failure(reason_code(outcome.reason))
            raise ServiceError(
                grpc.StatusCode.ABORTED,
                f"KV transfer of {rid} to {','.join(target.endpoints)} failed: {outcome.reason}",
            )
        self._metrics.kv_transfer_seconds.observe(time.monotonic() - started)
        self._metrics.kv_transfer_bytes.inc(layout.total_bytes)
        return layout.total_bytes

    @grpc_errors
    async def Abort(self, request: pdserve_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pdserve_pb2.AbortResponse:
        reason = request.reason or "aborted by caller"
        self._export.abort(request.request_id, reason)
        found = await self._loop.abort(request.request_id, "abort_rpc")
        return pdserve_pb2.AbortResponse(found=found)

    @grpc_errors
    async def GetLoad(self, request: pdserve_pb2.LoadRequest,
                      context: grpc.aio.ServicerContext) -> pdserve_pb2.LoadReport:
        return load_report(role="prefill", generation=self._generation, model=self._model,
                           max_model_len=self._limits.max_model_len,
                           block_size=self._loop.block_size, stats=self._loop.stats,
                           draining=self._gate.draining)


async def _first_output(stream: RequestStream) -> RequestOutput:
    """The output carrying the first sampled token (prefill_only requests
    finish with it; the engine may still send it in the finishing output)."""
    async for output in stream:
        if output.new_token_ids:
            return output
        if output.finished:
            raise ServiceError(grpc.StatusCode.INTERNAL,
                               f"request {output.request_id} finished "
                               f"({output.finish_reason}) without a first token")
    raise ServiceError(grpc.StatusCode.INTERNAL, "request stream ended without output")

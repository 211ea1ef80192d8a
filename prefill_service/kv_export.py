"""`KVExport`: a prefill rank's `LayerKVHook`, streaming each layer's KV to
the decode pod named in the request's target while later layers compute.

Every rank of a prefill pod runs one: rank 0's is the engine's hook and the
servicer's handle; a worker's (prefill_service/rank_export.py) is its
runner's hook, driven by rank 0's control messages. A rank sends only its
own KV heads, as its `RankSend`s (prefill_service/rank_sends.py): one
whole-layout transfer at TP=1 to TP=1 (today's wire), else one head-ranged
transfer per decode rank it writes to.

Life of one exported request (R), on rank 0:

    register(R, target, layout)      servicer, before the engine sees R
      -> REGISTERED                   (at TP > 1 also EXPORT to the workers)
    on_layer_kv(layer, cache, spans) engine loop thread, inside step(), per layer:
      first span of R: sender.begin per send            -> SENDING
      every span: extract_kv(cache, span.slot_mapping), this rank's heads
        -> per send, its heads' slice -> sender.send_layer
      (only the span's tokens from the layout's token offset on: the decode
       pod holds the ones before, a cache-miss-only transfer)
      (the sender only queues: its own threads, and on CUDA its own stream,
       move the bytes, so the engine never waits on the network)
    finish(R, first_token)           servicer, after R's first token arrived
      -> sender.end per send (+ FINISH to the workers) -> ENDED
         -> Future[TransferOutcome]: first failure wins (the rest is aborted),
            COMPLETE when every send and every worker's OUTCOME completed
    abort(R, reason)                 servicer on cancel/abort -> ABORTED (+ ABORT)
    forget(R)                        servicer, always, last (+ FORGET)

A worker's KVExport sees `register_sends` (its EXPORT), `finish`, `abort`
and `forget` from its control thread instead; its hook runs on its step
thread.

A failure inside the hook (a sender refusing the target, a bad shape) must
not kill the engine loop: R is marked FAILED with the reason, its senders
(and, on rank 0, the workers) are told to abort, and `finish` then returns
a failed outcome at once.

The table is shared between the loop thread (hook) and the event loop or
control thread (register/finish/abort/forget), so it is guarded by one
lock; sender calls happen outside it.
"""

from __future__ import annotations

import enum
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

import kernels
from engine.kv_hook import LayerKVSpan
from kernels.dispatch import Backend
from kv_transfer.base import KVLayout, KVSender, TransferOutcome, TransferTarget
from prefill_service.outcomes import first_failure
from prefill_service.rank_sends import RankSend, head_ranged, new_attempts, rank_sends
from prefill_service.senders import SenderFactory, SenderSets
from prefill_service.worker_exports import WorkerExports

log = logging.getLogger(__name__)


class ExportState(enum.Enum):
    REGISTERED = "registered"
    SENDING = "sending"
    ENDED = "ended"
    FAILED = "failed"
    ABORTED = "aborted"


_EXPORT_TRANSITIONS = {
    ExportState.REGISTERED: frozenset({ExportState.SENDING, ExportState.FAILED,
                                       ExportState.ABORTED}),
    ExportState.SENDING: frozenset({ExportState.ENDED, ExportState.FAILED, ExportState.ABORTED}),
    ExportState.ENDED: frozenset({ExportState.ABORTED}),
    ExportState.FAILED: frozenset({ExportState.ABORTED}),
    ExportState.ABORTED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class _Send:
    plan: RankSend
    sender: KVSender


@dataclass(slots=True)
class _Export:
    sends: tuple[_Send, ...]
    layout: KVLayout  # the whole request's (token offset, token count)
    state: ExportState = ExportState.REGISTERED
    reason: str = ""

    def to(self, new: ExportState) -> None:
        if new not in _EXPORT_TRANSITIONS[self.state]:
            raise RuntimeError(f"export state {self.state.value} -> {new.value} is not allowed")
        self.state = new


class KVExport:
    """The hook plus the per-request table of one prefill rank. `senders`
    maps a transport name ("tcp", "grpc") to the rank's sender for it;
    `more_senders` makes another such set when one request goes to several
    decode ranks from this rank (prefill_service/senders.py)."""

    def __init__(self, senders: dict[str, KVSender], *,
                 kernel_backend: Backend | str = Backend.AUTO,
                 more_senders: SenderFactory | None = None,
                 prefill_rank: int = 0, prefill_tp: int = 1) -> None:
        """`kernel_backend`: the engine's (`EngineConfig.kernel_backend`),
        for the extraction. `prefill_rank` / `prefill_tp`: this rank and the
        pod's size; rank 0 at TP > 1 needs `attach_workers` before `register`."""
        if not 0 <= prefill_rank < prefill_tp:
            raise ValueError(f"prefill rank {prefill_rank} is not in [0, {prefill_tp})")
        self._senders = SenderSets(senders, more_senders)
        self._kernel_backend = Backend.parse(kernel_backend)
        self.prefill_rank, self.prefill_tp = prefill_rank, prefill_tp
        self._workers: WorkerExports | None = None
        self._lock = threading.Lock()
        self._exports: dict[str, _Export] = {}

    def attach_workers(self, workers: WorkerExports) -> None:
        """Rank 0 of a TP > 1 pod, once the engine (and its workers) started."""
        if self.prefill_rank != 0 or workers.size != self.prefill_tp:
            raise ValueError(f"workers of a pod of {workers.size} ranks attached to rank "
                             f"{self.prefill_rank} of {self.prefill_tp}")
        self._workers = workers

    @property
    def open_requests(self) -> tuple[str, ...]:
        """The requests this rank still holds (registered, not forgotten)."""
        with self._lock:
            return tuple(self._exports)

    def register(self, request_id: str, target: TransferTarget, layout: KVLayout) -> None:
        """Rank 0: called by the servicer before `add_request`, with the
        whole model's layout; sends the workers EXPORT. ValueError for a
        transport this pod has no sender for, a duplicate id or a target
        whose decode ranks do not shard as this pod does."""
        if self.prefill_rank != 0:
            raise RuntimeError("register is rank 0's; a worker gets register_sends")
        if self.prefill_tp > 1 and self._workers is None:
            raise RuntimeError(f"rank 0 of a prefill pod at tensor_parallel_size "
                               f"{self.prefill_tp} exports before its workers were attached")
        attempts = new_attempts(target) if head_ranged(self.prefill_tp, target) else ()
        self.register_sends(request_id, layout,
                            rank_sends(target, layout, 0, self.prefill_tp, attempts))
        if self._workers is not None:
            try:
                self._workers.export(request_id, target, layout, attempts)
            except BaseException:
                self.forget(request_id)
                raise

    def register_sends(self, request_id: str, layout: KVLayout,
                       sends: tuple[RankSend, ...]) -> None:
        """This rank's sends of R (whole-model `layout`); ValueError for a
        transport without sender or a duplicate id."""
        if not sends:
            raise ValueError(f"request {request_id!r}: this rank has no heads to send")
        bound = tuple(_Send(send, self._senders.get(i, send.target.transport))
                      for i, send in enumerate(sends))
        with self._lock:
            if request_id in self._exports:
                raise ValueError(f"request {request_id!r} is already being exported")
            self._exports[request_id] = _Export(bound, layout)

    # ---------------------------------------------------------------- engine loop thread

    def on_layer_kv(self, layer_idx: int, kv_cache_layer: torch.Tensor,
                    spans: tuple[LayerKVSpan, ...]) -> None:
        for span in spans:
            with self._lock:
                export = self._exports.get(span.request_id)
                if export is None or export.state not in (ExportState.REGISTERED,
                                                          ExportState.SENDING):
                    continue
                first = export.state is ExportState.REGISTERED
                if first:
                    export.to(ExportState.SENDING)
            try:
                if first:
                    _begin(span.request_id, export.sends)
                self._send_span(span, layer_idx, kv_cache_layer, export)
            except Exception as exc:  # noqa: BLE001 - never kill the engine loop
                self._fail(span.request_id, export, f"{type(exc).__name__}: {exc}")

    def _send_span(self, span: LayerKVSpan, layer_idx: int, kv_cache_layer: torch.Tensor,
                   export: _Export) -> None:
        # The decode pod holds the context tokens before the layout's
        # offset (cache-miss-only transfer): send only the span's rest.
        offset = export.layout.token_offset
        if span.end <= offset:
            return
        slots = span.slot_mapping[max(0, offset - span.start):]
        # The cache slots may be overwritten by a later step: the gather
        # copies them out now (on CUDA, on the current stream; the sender
        # orders its D2H copy after it with an event). Extracted once, this
        # rank's heads; each send takes its heads' slice (a view: the
        # senders only read it).
        kv = kernels.extract_kv(kv_cache_layer, slots, backend=self._kernel_backend)
        token_start = max(span.start, offset) - offset
        for send in export.sends:
            start, end = send.plan.local_heads
            part = kv if (start, end) == (0, kv.shape[2]) else kv[:, :, start:end]
            send.sender.send_layer(span.request_id, layer_idx, part, token_start)

    def _fail(self, request_id: str, export: _Export, reason: str) -> None:
        log.warning("KV export of %s failed: %s", request_id, reason)
        with self._lock:
            if export.state in (ExportState.REGISTERED, ExportState.SENDING):
                export.to(ExportState.FAILED)
                export.reason = reason
        for send in export.sends:
            send.sender.abort(request_id, reason)
        if self._workers is not None:
            self._workers.abort(request_id, reason)

    # ---------------------------------------------------------------- servicer / control

    def finish(self, request_id: str, first_token_id: int) -> Future[TransferOutcome]:
        """END after every queued layer (and FINISH to the workers); the
        future holds the verdict: the first failure, or COMPLETE when every
        decode rank's verdict on every part is in."""
        with self._lock:
            export = self._exports[request_id]
            state, reason = export.state, export.reason
            if state is ExportState.SENDING:
                export.to(ExportState.ENDED)
        if state is not ExportState.SENDING:
            failed: Future[TransferOutcome] = Future()
            failed.set_result(TransferOutcome.failed(
                reason or f"no KV was sent (export state {state.value})"))
            if self._workers is not None:  # their parts cannot complete R any more
                self._workers.abort(request_id, failed.result().reason)
            return failed
        workers = [] if self._workers is None else self._workers.finish(request_id,
                                                                        first_token_id)
        if len(export.sends) == 1 and not workers:
            return export.sends[0].sender.end(request_id, first_token_id)  # TP=1 as ever
        parts = [send.sender.end(request_id, first_token_id) for send in export.sends]
        return first_failure(parts + workers,
                             on_failure=lambda why: self.abort(request_id, why))

    def abort(self, request_id: str, reason: str) -> None:
        """Stop sending R (client cancel, Abort RPC, engine abort, a part failed)."""
        with self._lock:
            export = self._exports.get(request_id)
            if export is None or export.state is ExportState.ABORTED:
                return
            begun = export.state is not ExportState.REGISTERED
            export.to(ExportState.ABORTED)
        if begun:
            for send in export.sends:
                send.sender.abort(request_id, reason)
        if self._workers is not None:
            self._workers.abort(request_id, reason)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._exports.pop(request_id, None)
        if self._workers is not None:
            self._workers.forget(request_id)

    def close(self) -> None:
        self._senders.close()


def _begin(request_id: str, sends: tuple[_Send, ...]) -> None:
    """BEGIN each send: a whole-layout TP=1 one as ever, a head-ranged one
    with its heads, the shared attempt id and how many ranks write its layout."""
    for send in sends:
        plan = send.plan
        if plan.heads is None:
            send.sender.begin(request_id, plan.target, plan.layout)
        else:
            send.sender.begin(request_id, plan.target, plan.layout, heads=plan.heads,
                              attempt=plan.attempt, num_senders=plan.num_senders)

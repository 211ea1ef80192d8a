"""`KVExport`: the prefill pod's `LayerKVHook`, streaming each layer's KV to
the decode pod named in the request's target while later layers compute.

Life of one exported request (R):

    register(R, target, layout)      servicer, before the engine sees R
      -> REGISTERED
    on_layer_kv(layer, cache, spans) engine loop thread, inside step(), per layer:
      first span of R: sender.begin  -> SENDING
      every span: extract_kv(cache, span.slot_mapping) -> sender.send_layer
      (only the span's tokens from the layout's token offset on: the decode
       pod holds the ones before, a cache-miss-only transfer)
      (the sender only queues: its own threads, and on CUDA its own stream,
       move the bytes, so the engine never waits on the network)
    finish(R, first_token)           servicer, after R's first token arrived
      -> sender.end -> Future[TransferOutcome]      -> ENDED
    abort(R, reason)                 servicer on cancel/abort -> ABORTED
    forget(R)                        servicer, always, last

A failure inside the hook (a sender refusing the target, a bad shape) must
not kill the engine loop: R is marked FAILED with the reason, the sender is
told to abort, and `finish` then returns a failed outcome at once.

The table is shared between the loop thread (hook) and the event loop
(register/finish/abort/forget), so it is guarded by one lock; sender calls
happen outside it.
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


@dataclass(slots=True)
class _Export:
    target: TransferTarget
    layout: KVLayout
    sender: KVSender
    state: ExportState = ExportState.REGISTERED
    reason: str = ""

    def to(self, new: ExportState) -> None:
        if new not in _EXPORT_TRANSITIONS[self.state]:
            raise RuntimeError(f"export state {self.state.value} -> {new.value} is not allowed")
        self.state = new


class KVExport:
    """The hook plus the per-request table. `senders` maps a transport name
    ("tcp", "grpc") to the pod's sender for it."""

    def __init__(self, senders: dict[str, KVSender], *,
                 kernel_backend: Backend | str = Backend.AUTO) -> None:
        """`kernel_backend`: the engine's (`EngineConfig.kernel_backend`), for the extraction."""
        if not senders:
            raise ValueError("KVExport needs at least one sender")
        self._senders = dict(senders)
        self._kernel_backend = Backend.parse(kernel_backend)
        self._lock = threading.Lock()
        self._exports: dict[str, _Export] = {}

    def register(self, request_id: str, target: TransferTarget, layout: KVLayout) -> None:
        """Called by the servicer before `add_request`; ValueError for a
        transport this pod has no sender for or a duplicate id."""
        sender = self._senders.get(target.transport)
        if sender is None:
            raise ValueError(f"target transport {target.transport!r} is not available on this "
                             f"prefill pod (available: {', '.join(self._senders)})")
        with self._lock:
            if request_id in self._exports:
                raise ValueError(f"request {request_id!r} is already being exported")
            self._exports[request_id] = _Export(target, layout, sender)

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
                    export.sender.begin(span.request_id, export.target, export.layout)
                # The decode pod holds the context tokens before the layout's
                # offset (cache-miss-only transfer): send only the span's rest.
                offset = export.layout.token_offset
                if span.end <= offset:
                    continue
                slots = span.slot_mapping[max(0, offset - span.start):]
                # The cache slots may be overwritten by a later step: the
                # gather copies them out now (on CUDA, on the current stream;
                # the sender orders its D2H copy after it with an event).
                kv = kernels.extract_kv(kv_cache_layer, slots, backend=self._kernel_backend)
                export.sender.send_layer(span.request_id, layer_idx, kv,
                                         max(span.start, offset) - offset)
            except Exception as exc:  # noqa: BLE001 - never kill the engine loop
                self._fail(span.request_id, export, f"{type(exc).__name__}: {exc}")

    def _fail(self, request_id: str, export: _Export, reason: str) -> None:
        log.warning("KV export of %s failed: %s", request_id, reason)
        with self._lock:
            if export.state in (ExportState.REGISTERED, ExportState.SENDING):
                export.to(ExportState.FAILED)
                export.reason = reason
        export.sender.abort(request_id, reason)

    # ---------------------------------------------------------------- servicer (event loop)

    def finish(self, request_id: str, first_token_id: int) -> Future[TransferOutcome]:
        """END after every queued layer; the future holds the decode pod's verdict."""
        with self._lock:
            export = self._exports[request_id]
            state, reason = export.state, export.reason
            if state is ExportState.SENDING:
                export.to(ExportState.ENDED)
        if state is ExportState.SENDING:
            return export.sender.end(request_id, first_token_id)
        failed: Future[TransferOutcome] = Future()
        failed.set_result(TransferOutcome.failed(
            reason or f"no KV was sent (export state {state.value})"))
        return failed

    def abort(self, request_id: str, reason: str) -> None:
        """Stop sending R (client cancel, Abort RPC, engine abort)."""
        with self._lock:
            export = self._exports.get(request_id)
            if export is None or export.state is ExportState.ABORTED:
                return
            begun = export.state is not ExportState.REGISTERED
            export.to(ExportState.ABORTED)
        if begun:
            export.sender.abort(request_id, reason)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._exports.pop(request_id, None)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()

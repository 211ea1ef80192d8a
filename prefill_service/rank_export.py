"""The prefill rank service: what each worker rank (1..a-1) of a prefill pod
at TP=a runs beside its steps, so that it sends its own KV heads.

Started by name in every worker (`EngineConfig.rank_service =
RANK_SERVICE`; engine/parallel/worker.py imports it, engine/ never imports
this package). Life of one request R on a worker, driven by rank 0's
control messages (prefill_service/rank_messages.py) on the worker's
control thread, and by its steps on its step thread:

    SETUP                 once: the worker's senders (rank 0's stream count and security)
    EXPORT R              control thread: this rank's sends of R (`rank_sends`, its
                          heads; the attempt ids rank 0 picked) -> KVExport.register_sends;
                          applied before the step that computes R (the step's control_seq)
    steps computing R     step thread, the runner's layer_kv_hook: `extract_kv` of this
                          rank's cache shard at R's spans (the very spans rank 0's hook
                          sees), each send's heads -> send_layer (queued, never blocking)
    FINISH R              END on every send; when all are decided: OUTCOME {ok, reason}
                          (sender I/O thread; the first failure wins)
    ABORT R               stop sending R (rank 0's request was cancelled or a part failed)
    FORGET R              drop R

By the time rank 0 sees R's first token, this rank has made every
`send_layer` call of R: the first token needs the lm_head gather of the
last layer's rows, which this rank joins only after its hook for every
layer of that step returned. So FINISH never overtakes data.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import torch

from engine.kv_hook import LayerKVSpan
from engine.parallel.control import WorkerControl
from engine.parallel.group import TPGroup
from engine.parallel.launch import WorkerSpec
from engine.parallel.rank import RankModel
from kv_transfer.base import TransferOutcome
from prefill_service.kv_export import KVExport
from prefill_service.rank_messages import Kind, parse_export, security_from
from prefill_service.rank_sends import rank_sends
from prefill_service.senders import make_senders

log = logging.getLogger(__name__)

RANK_SERVICE = "prefill_service.rank_export:start"


class RankExport:
    """A worker's `RankService`: its `KVExport` (the hook) and the control
    messages that drive it."""

    def __init__(self, rank: int, size: int, kernel_backend: str,
                 control: WorkerControl) -> None:
        self.rank, self.size = rank, size
        self._kernel_backend = kernel_backend
        self._control = control
        self._export: KVExport | None = None  # made at SETUP
        self.layer_kv_hook = self  # the runner's hook (RankService)

    def on_layer_kv(self, layer_idx: int, kv_cache_layer: torch.Tensor,
                    spans: tuple[LayerKVSpan, ...]) -> None:
        """The runner's hook (step thread); nothing to do before SETUP."""
        if self._export is not None:
            self._export.on_layer_kv(layer_idx, kv_cache_layer, spans)

    def on_control(self, kind: int, fields: dict[str, Any], payload: bytes) -> None:
        """Control thread, in order; an exception fails the worker (the pod
        goes down rather than serve with a rank that lost track)."""
        if kind == Kind.SETUP:
            self._setup(fields)
        elif kind == Kind.LIST:
            held = () if self._export is None else self._export.open_requests
            self._control.send(Kind.OPEN, {"request_ids": list(held)})
        elif self._export is None:
            raise RuntimeError(f"control message {kind} before SETUP")
        elif kind == Kind.EXPORT:
            request_id, target, layout, attempts = parse_export(fields)
            sends = rank_sends(target, layout, self.rank, self.size, attempts)
            self._export.register_sends(request_id, layout, sends)
        elif kind == Kind.FINISH:
            self._finish(fields["request_id"], fields["first_token_id"])
        elif kind == Kind.ABORT:
            self._export.abort(fields["request_id"], fields["reason"])
        elif kind == Kind.FORGET:
            self._export.forget(fields["request_id"])
        else:
            raise ValueError(f"unknown prefill control message kind {kind}")

    def _setup(self, fields: dict[str, Any]) -> None:
        if self._export is not None:
            raise RuntimeError("SETUP came twice")
        num_streams, security = fields["num_streams"], security_from(fields["security"])
        self._export = KVExport(make_senders(num_streams, security),
                                more_senders=lambda: make_senders(num_streams, security),
                                kernel_backend=self._kernel_backend,
                                prefill_rank=self.rank, prefill_tp=self.size)

    def _finish(self, request_id: str, first_token_id: int) -> None:
        verdict = self._export.finish(request_id, first_token_id)

        def answer(done: Future[TransferOutcome]) -> None:
            outcome = done.result()
            try:
                self._control.send(Kind.OUTCOME, {"request_id": request_id, "ok": outcome.ok,
                                                  "reason": outcome.reason})
            except OSError as exc:  # rank 0 is gone: this worker exits with it
                log.warning("OUTCOME of %s not sent: %s", request_id, exc)

        verdict.add_done_callback(answer)

    def close(self) -> None:
        if self._export is not None:
            self._export.close()


def start(spec: WorkerSpec, rank_model: RankModel, group: TPGroup,
          control: WorkerControl) -> RankExport:
    """The rank service's entry point (`RANK_SERVICE`), called by the worker
    after building its rank."""
    return RankExport(spec.rank, spec.size, spec.config.kernel_backend, control)

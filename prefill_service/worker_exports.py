"""`WorkerExports`: rank 0's side of a TP=a prefill pod's worker ranks'
exports (prefill_service/rank_export.py is the worker's side; the messages
are in prefill_service/rank_messages.py).

Life of one exported request R on rank 0, beside its own transfers
(`KVExport`):

    export(R, target, layout, attempts)   KVExport.register, before the engine sees R:
        EXPORT to each worker with heads to send (`sending_ranks`); one pending
        outcome future per such worker
    finish(R, first_token)                KVExport.finish: FINISH to each; the
        futures resolve with each worker's OUTCOME (control reader thread)
    abort(R, reason)                      ABORT to each
    forget(R)                             FORGET to each, the futures dropped

A worker that dies takes the pod down (TPLeader's watchdog); its pending
futures then fail at once with the pod's failure, so nothing waits on a
rank that will never answer. The table is guarded by one lock; control
sends happen outside it.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any

from engine.parallel.launch import TensorParallelError, TPLeader
from kv_transfer.base import KVLayout, TransferOutcome, TransferTarget
from kv_transfer.errors import Reason, make_reason
from prefill_service.rank_messages import Kind, export_fields, setup_fields
from prefill_service.rank_sends import sending_ranks
from proto.tls import PodSecurity

log = logging.getLogger(__name__)


class WorkerExports:
    """Rank 0's handle on the workers' exports; see the module docstring."""

    def __init__(self, leader: TPLeader, *, num_streams: int,
                 security: PodSecurity | None = None) -> None:
        """Sends every worker SETUP (before any step can export). `leader`
        must have control channels (the engine was built with the prefill
        rank service)."""
        if not leader.has_control:
            raise ValueError("a prefill pod at tensor_parallel_size > 1 needs its workers "
                             "started with the prefill rank service (EngineConfig.rank_service)")
        self._leader = leader
        self.size = leader.size
        self._lock = threading.Lock()
        self._pending: dict[str, dict[int, Future[TransferOutcome]]] = {}
        self._open: queue.Queue[tuple[int, list[str]]] = queue.Queue()
        leader.on_control(self._on_control)
        leader.on_failure(self._on_pod_failure)
        fields = setup_fields(num_streams, security or PodSecurity())
        for rank in range(1, self.size):
            leader.control_send(rank, Kind.SETUP, fields)

    def export(self, request_id: str, target: TransferTarget, layout: KVLayout,
               attempts: tuple[bytes, ...]) -> None:
        """EXPORT R to every worker that sends part of it. TensorParallelError
        when the pod is down (nothing is left registered)."""
        ranks = [r for r in sending_ranks(layout.num_kv_heads, self.size, target) if r]
        with self._lock:
            if request_id in self._pending:
                raise ValueError(f"request {request_id!r} is already being exported")
            self._pending[request_id] = {rank: Future() for rank in ranks}
        fields = export_fields(request_id, target, layout, attempts)
        try:
            for rank in ranks:
                self._leader.control_send(rank, Kind.EXPORT, fields)
        except BaseException:
            self.forget(request_id)
            raise

    def finish(self, request_id: str, first_token_id: int) -> list[Future[TransferOutcome]]:
        """FINISH to R's workers; their OUTCOME futures (empty when none sends)."""
        with self._lock:
            pending = dict(self._pending.get(request_id, {}))
        for rank, future in pending.items():
            try:
                self._leader.control_send(rank, Kind.FINISH, {
                    "request_id": request_id, "first_token_id": first_token_id})
            except TensorParallelError as exc:
                _settle(future, TransferOutcome.failed(make_reason(Reason.ABORTED, str(exc))))
        return list(pending.values())

    def abort(self, request_id: str, reason: str) -> None:
        self._tell(request_id, Kind.ABORT, {"request_id": request_id, "reason": reason})

    def forget(self, request_id: str) -> None:
        self._tell(request_id, Kind.FORGET, {"request_id": request_id}, drop=True)

    def open_requests(self, timeout: float = 10.0) -> dict[int, list[str]]:
        """Each worker's requests still held (LIST/OPEN), for tests and
        debugging; only one caller at a time."""
        for rank in range(1, self.size):
            self._leader.control_send(rank, Kind.LIST, {})
        answers = dict(self._open.get(timeout=timeout) for _ in range(1, self.size))
        return dict(sorted(answers.items()))

    # ------------------------------------------------------------ control reader threads

    def _tell(self, request_id: str, kind: Kind, fields: dict[str, Any], *,
              drop: bool = False) -> None:
        with self._lock:
            pending = (self._pending.pop(request_id, None) if drop
                       else self._pending.get(request_id))
        for rank in pending or ():
            try:
                self._leader.control_send(rank, kind, fields)
            except TensorParallelError as exc:
                # the pod is going down: its workers (and their transfers) with it
                log.warning("%s of %s to rank %d not sent: %s", kind.name, request_id, rank, exc)
                return

    def _on_control(self, rank: int, kind: int, fields: dict[str, Any], payload: bytes) -> None:
        if kind == Kind.OPEN:
            self._open.put((rank, list(fields["request_ids"])))
            return
        if kind != Kind.OUTCOME:
            log.warning("unexpected control message %d from prefill rank %d", kind, rank)
            return
        with self._lock:
            future = self._pending.get(fields["request_id"], {}).get(rank)
        if future is not None:
            # the worker's reason keeps its code first (metrics key on it)
            outcome = TransferOutcome.complete() if fields["ok"] else TransferOutcome.failed(
                f"{fields['reason']} (from tensor-parallel rank {rank})")
            _settle(future, outcome)

    def _on_pod_failure(self) -> None:
        """Watchdog thread: a rank died; fail every outcome still pending."""
        with self._lock:
            futures = [f for pending in self._pending.values() for f in pending.values()]
        reason = make_reason(Reason.ABORTED, f"tensor-parallel pod failed: {self._leader.failure}")
        for future in futures:
            _settle(future, TransferOutcome.failed(reason))


def _settle(future: Future[TransferOutcome], outcome: TransferOutcome) -> None:
    """Set `future` unless something else did first."""
    try:
        future.set_result(outcome)
    except InvalidStateError:  # already decided
        pass

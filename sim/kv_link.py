"""The simulated KV transfer: a prefill pod's "send" lands in a decode pod's
reservation after the modelled transfer time, and no byte moves.

Who uses it: the real `PrefillServicer` takes a `SimExport` where a real
pod has its `KVExport` (`register`, `finish`, `abort`, `forget`); the real
`DecodeServicer`'s `KVImport` takes a `SimReceiver` and a `SimInjector` in
its `RemoteKV` where a real pod has its receiver and injector (`expect`,
`release`, `cancel` / `expect`, `forget`). So reservation, ticket,
deadline, commit and the safe-order free are the real pods' code; only
the wire is replaced.

The mechanism (the simplest honest one): every simulated pod of a process
shares one `SimFabric`, which maps a decode pod's KV endpoint (its own gRPC
address, transport "grpc") to its `SimReceiver`. A transfer of request R:

    decode pod   KVImport.open(R) -> injector.expect(R), receiver.expect(R):
                 a random ticket and the reservation deadline; target = D's endpoint
    router       carries the target to the prefill pod (Reserved -> Prefill)
    prefill pod  register(R, target, layout) ... first token sampled ...
                 finish(R, token): a task sleeps PerfModel.transfer_seconds(
                 the layout's bytes), then fabric[endpoint].land(R, ticket, bytes,
                 token) -> the outcome the prefill RPC reports
    decode pod   land: checks R is expected, the ticket and the byte count, then
                 the injector's on_ready(token) queues R's commit (KVImport) and
                 its future settles: R decodes from the next step

Failures are the real ones by name (kv_transfer/errors.py `Reason`): an
endpoint of no simulated pod in this process `connect_failed`, a request
the decode pod no longer expects `unknown_request`, a wrong ticket
`bad_ticket`, a wrong size `size_mismatch`, the reservation deadline
passing `deadline`, the prefill pod aborting a started transfer `aborted`.
A cross-process transfer is not simulated: prefill and decode pods that
exchange KV must run in one `pdserve sim` process.

Everything here runs on the one event loop of the simulated pods.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from prometheus_client import Counter

from decode_service.injector import TransferFailed
from kv_transfer.base import KVLayout, TransferOutcome, TransferTarget
from kv_transfer.errors import Reason, make_reason
from sim.perf_model import PerfModel


class SimFabric:
    """Decode pods' receivers by endpoint, shared by the pods of one process."""

    def __init__(self) -> None:
        self._receivers: dict[str, SimReceiver] = {}

    def attach(self, receiver: SimReceiver) -> None:
        self._receivers[receiver.endpoint] = receiver

    def detach(self, receiver: SimReceiver) -> None:
        if self._receivers.get(receiver.endpoint) is receiver:
            del self._receivers[receiver.endpoint]

    def receiver(self, endpoint: str) -> SimReceiver | None:
        return self._receivers.get(endpoint)


@dataclass(slots=True)
class _Expected:
    ticket: bytes
    num_bytes: int
    deadline: asyncio.TimerHandle


class SimInjector:
    """The decode side's per-request "injection": a future that settles with
    the first token once the KV landed, after `on_ready` ran. `landed_bytes`
    (the pod's `pdserve_kv_transfer_bytes_total`) counts what landed, as the
    real injector counts it."""

    def __init__(self, landed_bytes: Counter | None = None) -> None:
        self._waiting: dict[str, tuple[asyncio.Future[int], Callable[[int], None] | None,
                                       int]] = {}
        self._landed_bytes = landed_bytes

    def expect(self, request_id: str, slot_mapping: object, num_layers: int, total_bytes: int,
               *, on_ready: Callable[[int], None] | None = None, split: object = None
               ) -> asyncio.Future[int]:
        if split is not None:
            raise ValueError("split prefill is not simulated")
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (future, on_ready, total_bytes)
        return future

    def complete(self, request_id: str, first_token_id: int) -> None:
        entry = self._waiting.pop(request_id, None)
        if entry is None:
            return
        future, on_ready, num_bytes = entry
        try:
            if on_ready is not None:
                on_ready(first_token_id)  # queues R's commit, as the injector thread does
        except Exception as exc:  # noqa: BLE001 - the engine loop stopped: R fails
            future.set_exception(TransferFailed(request_id, make_reason(Reason.CLOSED,
                                                                         str(exc))))
            return
        if self._landed_bytes is not None:
            self._landed_bytes.inc(num_bytes)
        future.set_result(first_token_id)

    def fail(self, request_id: str, reason: str) -> None:
        entry = self._waiting.pop(request_id, None)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(TransferFailed(request_id, reason))

    async def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)


class SimReceiver:
    """A decode pod's landing side: tickets, deadlines, the byte check."""

    def __init__(self, endpoint: str, generation: int, injector: SimInjector) -> None:
        self.endpoint = endpoint
        self.generation = generation
        self._injector = injector
        self._expected: dict[str, _Expected] = {}

    def expect(self, request_id: str, layout: KVLayout, deadline: float, *,
               transfer_timeout_s: float | None = None) -> TransferTarget:
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, deadline - time.time())
        timer = loop.call_at(when, self._expire, request_id)
        ticket = secrets.token_bytes(16)
        self._expected[request_id] = _Expected(ticket, layout.total_bytes, timer)
        return TransferTarget(endpoints=(self.endpoint,), ticket=ticket, transport="grpc",
                              generation=self.generation, deadline=deadline)

    def land(self, request_id: str, ticket: bytes, num_bytes: int,
             first_token_id: int) -> TransferOutcome:
        """The prefill pod's transfer of R arrived whole (its modelled time over)."""
        expected = self._expected.get(request_id)
        if expected is None:
            return TransferOutcome.failed(make_reason(Reason.UNKNOWN_REQUEST, request_id))
        if ticket != expected.ticket:
            return TransferOutcome.failed(make_reason(Reason.BAD_TICKET, request_id))
        if num_bytes != expected.num_bytes:
            return TransferOutcome.failed(make_reason(
                Reason.SIZE_MISMATCH, f"{num_bytes} bytes sent, {expected.num_bytes} expected"))
        expected.deadline.cancel()
        self._injector.complete(request_id, first_token_id)
        return TransferOutcome.complete()

    def abort(self, request_id: str, reason: str) -> None:
        """The prefill pod aborted R's started transfer."""
        if request_id in self._expected:
            self._injector.fail(request_id, make_reason(Reason.ABORTED, reason))

    def _expire(self, request_id: str) -> None:
        if request_id in self._expected:
            self._injector.fail(request_id, make_reason(
                Reason.DEADLINE, "no KV by the reservation deadline"))

    def release(self, request_id: str) -> bool:
        expected = self._expected.pop(request_id, None)
        if expected is not None:
            expected.deadline.cancel()
        return expected is not None

    def cancel(self, request_id: str, reason: str) -> bool:
        return self.release(request_id)


@dataclass(slots=True)
class _Export:
    target: TransferTarget
    layout: KVLayout
    sending: asyncio.Task[None] | None = None
    verdict: Future[TransferOutcome] | None = None


class SimExport:
    """A prefill pod's sending side (`KVExport`'s calls from `PrefillServicer`)."""

    def __init__(self, fabric: SimFabric, perf: PerfModel) -> None:
        self._fabric = fabric
        self._perf = perf
        self._exports: dict[str, _Export] = {}

    def register(self, request_id: str, target: TransferTarget, layout: KVLayout) -> None:
        if target.ranks:
            raise ValueError("a simulated prefill pod sends to TP=1 decode pods only")
        self._exports[request_id] = _Export(target, layout)

    def finish(self, request_id: str, first_token_id: int) -> Future[TransferOutcome]:
        """R's prompt is computed: its KV lands after the modelled transfer time;
        the future settles with the decode pod's verdict."""
        export = self._exports[request_id]
        verdict: Future[TransferOutcome] = Future()
        export.verdict = verdict
        export.sending = asyncio.get_running_loop().create_task(
            self._send(request_id, export, first_token_id, verdict))
        return verdict

    async def _send(self, request_id: str, export: _Export, first_token_id: int,
                    verdict: Future[TransferOutcome]) -> None:
        layout, target = export.layout, export.target
        compute_s = self._perf.prefill_seconds(layout.num_tokens)
        await asyncio.sleep(self._perf.transfer_seconds(layout.total_bytes, layout.num_layers,
                                                        compute_s))
        receiver = self._fabric.receiver(target.endpoints[0])
        if receiver is None:
            outcome = TransferOutcome.failed(make_reason(
                Reason.CONNECT_FAILED, f"{target.endpoints[0]} is no simulated decode pod of "
                                       "this process"))
        else:
            outcome = receiver.land(request_id, target.ticket, layout.total_bytes,
                                    first_token_id)
        if not verdict.done():  # the prefill RPC may be gone (cancelled)
            verdict.set_result(outcome)

    def abort(self, request_id: str, reason: str) -> None:
        export = self._exports.get(request_id)
        if export is None or export.sending is None or export.sending.done():
            return
        export.sending.cancel()
        if export.verdict is not None and not export.verdict.done():
            export.verdict.set_result(TransferOutcome.failed(make_reason(Reason.ABORTED, reason)))
        receiver = self._fabric.receiver(export.target.endpoints[0])
        if receiver is not None:
            receiver.abort(request_id, reason)

    def forget(self, request_id: str) -> None:
        self._exports.pop(request_id, None)

"""`DecodeRanks`: rank 0's side of a decode pod at TP=b > 1 -- its worker
ranks' KV receivers, driven over the control channel (messages in
decode_service/rank_wire.py; a worker's side is decode_service/rank_kv.py).

At start (`start`, the pod's event loop, before it serves): SETUP to every
worker (its receiver's config: the pod's transport, security, ticket secret
and generation, port --kv-port + rank), then every READY awaited: `targets`
is each rank's endpoints and head range, rank order, for every Reserved.

Per request R (`KVImport`, the pod's event loop):

    expect(R)   EXPECT to every worker (its head range's layout, the shared
                deadline, R's slot mapping); `RankLanding.expecting` resolves
                once every worker sent EXPECTING (only then may R's target go
                out), `landed` with the first token once every worker sent
                LANDED (all the same token); both raise TransferFailed at the
                first FAILED
    forget(R)   FORGET to every worker; returns once every FORGOTTEN is in:
                no worker writes R's slots any more, so rank 0 may free them

Replies arrive on the workers' control reader threads and are handed to the
event loop (`call_soon_threadsafe`). A worker that dies takes the pod down
(the watchdog); every pending future then fails or resolves at once
(`_pod_failed`), so no request waits for a rank that is gone.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from decode_service.injector import TransferFailed
from decode_service.rank_wire import RankKind, layout_fields, rank_layout, receiver_fields
from engine.parallel.launch import TPLeader
from kv_transfer.base import KVLayout, RankTarget
from kv_transfer.config import ReceiverConfig
from kv_transfer.errors import Reason, make_reason


@dataclass(frozen=True, slots=True)
class RankLanding:
    """The worker ranks' side of one request's import (event-loop futures)."""

    expecting: asyncio.Future[None]  # every worker expects R
    landed: asyncio.Future[int]  # every worker's heads are in: the first token


@dataclass(slots=True)
class _Waiting:
    """Replies still due from worker ranks for one request."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    ranks: set[int]
    tokens: dict[int, int] = field(default_factory=dict)
    expecting: asyncio.Future[None] | None = None  # with the ranks not expecting yet
    not_expecting: set[int] = field(default_factory=set)


class DecodeRanks:
    """Rank 0's handle on the decode worker ranks; see the module docstring."""

    def __init__(self, tp: TPLeader, own: RankTarget) -> None:
        self._tp = tp
        self._own = own
        self._lock = threading.Lock()
        self._ready: dict[int, RankTarget] = {}
        self._all_ready = threading.Event()
        self._landing: dict[str, _Waiting] = {}
        self._forgetting: dict[str, _Waiting] = {}
        self._failure: str | None = None
        self.targets: tuple[RankTarget, ...] = ()
        tp.on_control(self._on_message)
        tp.on_failure(self._pod_failed)

    @property
    def size(self) -> int:
        return self._tp.size

    def start(self, transport: str, configs: list[ReceiverConfig], timeout_s: float
              ) -> tuple[RankTarget, ...]:
        """SETUP each worker (`configs[r - 1]` is rank r's receiver), wait for
        every READY (blocking; call it off the event loop). RuntimeError when
        a rank is not ready within `timeout_s`."""
        for rank, config in enumerate(configs, start=1):
            self._tp.control_send(rank, RankKind.SETUP,
                                  {"transport": transport, "receiver": receiver_fields(config)})
        if not self._all_ready.wait(timeout_s):
            missing = sorted(set(range(1, self.size)) - set(self._ready))
            raise RuntimeError(f"decode ranks {missing} did not start their KV receivers within "
                               f"{timeout_s:g}s")
        self._tp.check()
        self.targets = (self._own, *(self._ready[r] for r in range(1, self.size)))
        return self.targets

    def head_range(self, rank: int) -> tuple[int, int]:
        target = self.targets[rank]
        return target.head_start, target.head_end

    def expect(self, request_id: str, layout: KVLayout, deadline: float,
               transfer_timeout_s: float, slot_mapping: torch.Tensor) -> RankLanding:
        """Event loop: every worker expects its heads of R (`layout` is the
        whole model's)."""
        loop = asyncio.get_running_loop()
        landing = RankLanding(loop.create_future(), loop.create_future())
        workers = set(range(1, self.size))
        with self._lock:
            if self._failure is not None:
                raise TransferFailed(request_id, make_reason(Reason.ABORTED, self._failure))
            self._landing[request_id] = _Waiting(loop, landing.landed, set(workers),
                                                 expecting=landing.expecting,
                                                 not_expecting=set(workers))
        payload = slot_mapping.to("cpu", torch.int64).contiguous().numpy().tobytes()
        for rank in range(1, self.size):
            fields = {"request_id": request_id, "deadline": deadline,
                      "transfer_timeout_s": transfer_timeout_s,
                      "layout": layout_fields(rank_layout(layout, *self.head_range(rank)))}
            self._tp.control_send(rank, RankKind.EXPECT, fields, payload)
        return landing

    async def forget(self, request_id: str, timeout_s: float) -> None:
        """Every worker lets go of R (FORGET, then each FORGOTTEN). R's
        landing future, if still pending, is cancelled. RuntimeError when a
        worker does not answer within `timeout_s` (R's blocks must then stay
        held: a stalled rank may still write them)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            landing = self._landing.pop(request_id, None)
            failed = self._failure is not None
            if not failed:
                self._forgetting[request_id] = _Waiting(loop, future, set(range(1, self.size)))
        if landing is not None:
            for pending in (landing.future, landing.expecting):
                if not pending.done():
                    pending.cancel()
        if failed:
            return  # the workers are gone: nothing writes R's slots
        for rank in range(1, self.size):
            self._tp.control_send(rank, RankKind.FORGET, {"request_id": request_id})
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            raise RuntimeError(f"decode ranks did not forget {request_id} within "
                               f"{timeout_s:g}s") from None
        finally:
            with self._lock:
                self._forgetting.pop(request_id, None)

    # ------------------------------------------------------------ reader threads

    def _on_message(self, rank: int, kind: int, fields: dict[str, Any], payload: bytes) -> None:
        kind = RankKind(kind)
        if kind is RankKind.READY:
            with self._lock:
                self._ready[rank] = RankTarget(tuple(fields["endpoints"]), fields["head_start"],
                                               fields["head_end"])
                if len(self._ready) == self.size - 1:
                    self._all_ready.set()
            return
        rid = fields["request_id"]
        table = self._forgetting if kind is RankKind.FORGOTTEN else self._landing
        with self._lock:
            waiting = table.get(rid)
            if waiting is None or rank not in waiting.ranks:
                return  # R was forgotten meanwhile: a late reply
            if kind is RankKind.EXPECTING:
                waiting.not_expecting.discard(rank)
                if not waiting.not_expecting:
                    waiting.loop.call_soon_threadsafe(_settle, waiting.expecting, None)
                return
            waiting.ranks.discard(rank)
            if kind is RankKind.FAILED:
                del table[rid]
                outcome: object = TransferFailed(rid, fields["reason"])
                waiting.loop.call_soon_threadsafe(_settle, waiting.expecting, outcome)
            elif kind is RankKind.LANDED:
                waiting.tokens[rank] = fields["first_token_id"]
                if waiting.ranks:
                    return
                del table[rid]
                outcome = _one_token(rid, waiting.tokens)
            else:  # FORGOTTEN
                if waiting.ranks:
                    return
                del table[rid]
                outcome = None
        waiting.loop.call_soon_threadsafe(_settle, waiting.future, outcome)

    def _pod_failed(self) -> None:
        """The watchdog thread: a rank died; nothing will answer any more."""
        reason = self._tp.failure or "a tensor-parallel rank failed"
        with self._lock:
            self._failure = reason
            landing, self._landing = self._landing, {}
            forgetting, self._forgetting = self._forgetting, {}
            self._all_ready.set()
        for rid, waiting in landing.items():
            failed = TransferFailed(rid, make_reason(Reason.ABORTED, reason))
            for future in (waiting.expecting, waiting.future):
                waiting.loop.call_soon_threadsafe(_settle, future, failed)
        for waiting in forgetting.values():
            waiting.loop.call_soon_threadsafe(_settle, waiting.future, None)


def _one_token(rid: str, tokens: dict[int, int]) -> int | TransferFailed:
    """Every rank's END carries the same first token; anything else fails R."""
    values = set(tokens.values())
    if len(values) == 1:
        return values.pop()
    return TransferFailed(rid, make_reason(Reason.ABORTED, f"decode ranks landed different "
                                                           f"first tokens {tokens}"))


def _settle(future: asyncio.Future, outcome: object) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)

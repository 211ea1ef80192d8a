"""`DecodeRankService`: the KV receive side of a decode pod's worker rank
(TP > 1), started by name in each worker (`EngineConfig.rank_service =
RANK_SERVICE`, engine/parallel/control.py) once its rank is built.

Each worker rank lands and injects only its own KV heads: its own receiver
(its own port, the pod's transport, ticket secret and generation, so rank
0's ticket is valid here too) and its own `KVInjector` over its cache
shard. Rank 0 (decode_service/rank_links.py) drives it over the control
channel, messages in decode_service/rank_wire.py.

Life of request R on a worker rank:

    EXPECT (control thread): injector.expect(R) then receiver.expect(R), both
        on this rank's asyncio loop (the injector's futures live there),
        before the control thread takes the next message ─> EXPECTING (rank
        0 hands R's target out only after every rank's)
        │ expect refused (landing pool full, ...) ─> FAILED, nothing held
        v
    landing (a task on the loop): the receiver lands this rank's heads of
        each layer, the injector writes them into this shard
        │ every layer in and END accepted: landing released ─> LANDED
        │ the transfer failed ─> FAILED (rank 0 then sends FORGET)
    FORGET (any time): the landing task cancelled, the receiver cancelled,
        the injector lets go of R, the landing buffer released ─> FORGOTTEN;
        only then does rank 0 free R's blocks.

Threads: the worker's control thread (on_control, one message at a time),
this service's asyncio loop thread, the receiver's I/O threads and the
injector thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any

import torch

from decode_service.injector import KVInjector, TransferFailed
from decode_service.rank_wire import RankKind, layout_of, receiver_config_of
from decode_service.receivers import open_receiver
from engine.metrics import PodMetrics
from engine.parallel.control import WorkerControl
from engine.parallel.launch import WorkerSpec
from engine.parallel.rank import RankModel
from kv_transfer.base import KVReceiver
from kv_transfer.errors import Reason, make_reason
from proto.roles import PodRole

log = logging.getLogger(__name__)

RANK_SERVICE = "decode_service.rank_kv:start"
_CLOSE_TIMEOUT_S = 5.0


class DecodeRankService:
    """One worker rank's receiver and injector; see the module docstring."""

    layer_kv_hook = None  # a decode rank streams nothing out

    def __init__(self, rank: int, head_range: tuple[int, int], kv_caches: list[torch.Tensor],
                 kernel_backend: str, control: WorkerControl) -> None:
        self._rank = rank
        self._head_range = head_range
        self._caches = kv_caches
        self._kernel_backend = kernel_backend
        self._control = control
        self._device = kv_caches[0].device
        self._receiver: KVReceiver | None = None
        self._injector: KVInjector | None = None
        self._landing: dict[str, asyncio.Task[None]] = {}  # the loop thread's
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rank-kv-loop",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ control thread

    def on_control(self, kind: int, fields: dict[str, Any], payload: bytes) -> None:
        kind = RankKind(kind)
        if kind is RankKind.SETUP:
            self._setup(fields)
        elif kind is RankKind.EXPECT:
            self._on_loop(self._expect(fields, payload)).result()
        elif kind is RankKind.FORGET:
            self._on_loop(self._forget(fields["request_id"]))
        else:
            raise ValueError(f"a decode worker rank does not take {kind.name}")

    def _setup(self, fields: dict[str, Any]) -> None:
        """Start the receiver (and its injector); answer READY."""
        if self._receiver is not None:
            raise ValueError("SETUP came twice")
        self._injector = KVInjector(self._caches, PodMetrics.create(PodRole.DECODE),
                                    kernel_backend=self._kernel_backend)
        self._receiver = open_receiver(fields["transport"], receiver_config_of(fields["receiver"]),
                                       self._injector)
        self._receiver.start()
        log.info("decode rank %d: KV heads [%d, %d) land at %s", self._rank, *self._head_range,
                 ", ".join(self._receiver.endpoints))
        self._send(RankKind.READY, endpoints=list(self._receiver.endpoints),
                   head_start=self._head_range[0], head_end=self._head_range[1])

    def _on_loop(self, coroutine: Coroutine[Any, Any, None]):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _send(self, kind: RankKind, **fields: Any) -> None:
        try:
            self._control.send(kind, fields)
        except OSError:  # rank 0 is gone: this worker is about to exit too
            log.warning("decode rank %d: %s not sent, rank 0 is gone", self._rank, kind.name)

    # ------------------------------------------------------------ the loop thread

    async def _expect(self, fields: dict[str, Any], payload: bytes) -> None:
        assert self._receiver is not None and self._injector is not None, "EXPECT before SETUP"
        rid = fields["request_id"]
        layout = layout_of(fields["layout"])
        slots = torch.frombuffer(bytearray(payload), dtype=torch.int64).to(self._device)
        ready = self._injector.expect(rid, slots, layout.num_layers, layout.total_bytes)
        try:
            self._receiver.expect(rid, layout, fields["deadline"],
                                  transfer_timeout_s=fields["transfer_timeout_s"])
        except Exception as exc:  # noqa: BLE001 - told to rank 0, which fails R
            await self._injector.forget(rid)
            self._send(RankKind.FAILED, request_id=rid,
                       reason=make_reason(Reason.ABORTED, f"decode rank {self._rank} could not "
                                          f"expect its KV: {type(exc).__name__}: {exc}"))
            return
        self._landing[rid] = asyncio.get_running_loop().create_task(self._land(rid, ready))
        self._send(RankKind.EXPECTING, request_id=rid)

    async def _land(self, rid: str, ready: asyncio.Future[int]) -> None:
        try:
            first_token_id = await ready
        except TransferFailed as exc:
            self._send(RankKind.FAILED, request_id=rid, reason=exc.reason)
            return
        finally:
            self._landing.pop(rid, None)
        self._receiver.release(rid)  # the injector is done with the landing buffer
        self._send(RankKind.LANDED, request_id=rid, first_token_id=first_token_id)

    async def _forget(self, rid: str) -> None:
        task = self._landing.pop(rid, None)
        if task is not None:
            task.cancel()
        self._receiver.cancel(rid, f"decode request ended before commit (rank {self._rank})")
        await self._injector.forget(rid)
        self._receiver.release(rid)
        self._send(RankKind.FORGOTTEN, request_id=rid)

    # ------------------------------------------------------------ worker stop

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self._injector is not None:
            self._injector.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_CLOSE_TIMEOUT_S)


def start(spec: WorkerSpec, rank: RankModel, group: object,
          control: WorkerControl) -> DecodeRankService:
    """The rank service function (`RANK_SERVICE`): this rank's heads are its
    shard's (engine.parallel.shard)."""
    shard = rank.loaded.model.shard
    return DecodeRankService(spec.rank, (shard.kv_head_start, shard.kv_head_end),
                             rank.kv_caches, spec.config.kernel_backend, control)

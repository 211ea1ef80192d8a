"""`KVInjector`: writes KV arriving from prefill pods into the decode pod's
paged cache, layer by layer, while the engine keeps stepping its batch.

Threads:

* receiver I/O threads (and its sweeper) call the `KVReceiveListener`
  hooks; each only queues an item, so the receiver never waits on injection;
* one **injector thread** takes items in order and runs
  `kernels.inject_kv(cache[layer], landing_view, reservation.slot_mapping)`.
  On CUDA the H2D copy and the scatter run on the injector's own CUDA stream;
  before a request is declared ready the thread waits on that stream's event,
  so the engine's default stream is never blocked and never reads a slot
  before its KV is in. On CPU the scatter runs on this thread (torch releases
  the GIL), beside the engine loop thread;
* the decode pod's `KVImport` (event loop) calls `expect` and `forget`.

Receiver hooks and `forget` reach the injector thread as typed items on one
FIFO queue (`_LayerReady`, `_Complete`, `_Failed`, `_Restart`, `_Forget`,
`_Stop`), so a request's items are handled in the order they were queued.

Life of one request R (per-request state, checked transitions):

    expect(R)           -> WAITING   (slots reserved by the engine; future pending)
    layer l ready       -> INJECTING (layers 0..l injected, in order)
    sender lost         -> WAITING   (on_restart: the receiver waits for another
                                     prefill pod's attempt; layers come again from
                                     0 and overwrite the same reserved slots)
    END accepted        -> READY     once all layers are in: `on_ready(first token)`
                                     (the decode pod queues R's commit on the engine
                                     loop from here), R leaves the table (the thread
                                     never touches it again), future = first token
    failed              -> FAILED    future = TransferFailed(reason)
    forget(R)           -> (removed) after this returns, the injector thread never
                                     touches R's slots or landing views again,
                                     so the engine may free the blocks and the
                                     receiver the landing buffer.

Only the engine writes R's slots after commit; only the injector before.

Beside the writes, the injector thread reports each request's layers and
END, with the times it read, to the pod's `TransferETA`
(decode_service/transfer_eta.py: when transfers are expected to end, for
the engine loop's join hold), and keeps a split prefill's head gate
(`SplitHead`, decode_service/split_head.py), and for a sampled trace's
request only (telemetry.kv_traces) each layer's arrival and injection times.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import kernels
from decode_service.split_head import SplitHead
from decode_service.transfer_eta import TransferETA
from engine.metrics import PodMetrics
from kernels.dispatch import Backend
from kv_transfer.base import KVReceiveListener
from telemetry import kv_traces

log = logging.getLogger(__name__)
_RESTART_WAIT_S = 30.0


class TransferFailed(Exception):
    """R's KV will not arrive; `reason` is kv_transfer's reason string."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"KV transfer of {request_id} failed: {reason}")
        self.request_id = request_id
        self.reason = reason


class InjectState(enum.Enum):
    WAITING = "waiting"
    INJECTING = "injecting"
    READY = "ready"
    FAILED = "failed"


_INJECT_TRANSITIONS = {
    InjectState.WAITING: frozenset({InjectState.INJECTING, InjectState.READY,
                                    InjectState.FAILED}),
    InjectState.INJECTING: frozenset({InjectState.WAITING, InjectState.INJECTING,
                                      InjectState.READY, InjectState.FAILED}),
    InjectState.READY: frozenset(),
    InjectState.FAILED: frozenset(),
}


@dataclass(slots=True)
class _Pending:
    slot_mapping: torch.Tensor
    num_layers: int
    num_bytes: int
    future: asyncio.Future[int]
    loop: asyncio.AbstractEventLoop
    on_ready: Callable[[int], object] | None
    split: SplitHead | None = None  # a split prefill's head
    state: InjectState = InjectState.WAITING
    layers_done: int = 0
    first_layer_at: float | None = None  # for kv_injection_seconds
    reason: str = field(default="")

    def to(self, new: InjectState) -> None:
        if new not in _INJECT_TRANSITIONS[self.state]:
            raise RuntimeError(f"inject state {self.state.value} -> {new.value} is not allowed")
        self.state = new

    def ready(self, first_token_id: int) -> None:
        """Injector thread: every layer is in -> READY, the future gets the token."""
        self.to(InjectState.READY)
        self.loop.call_soon_threadsafe(_resolve, self.future, first_token_id)

    def fail(self, exc: TransferFailed) -> None:
        """Injector thread: -> FAILED, the future raises `exc` (and a split's
        gate opens: the engine voids the tail)."""
        if self.split is not None:
            self.split.lost()
        self.to(InjectState.FAILED)
        self.reason = exc.reason
        self.loop.call_soon_threadsafe(_reject, self.future, exc)

    @property
    def settled(self) -> bool:
        return self.state in (InjectState.READY, InjectState.FAILED)


# Items for the injector thread, in queue order.

@dataclass(frozen=True, slots=True)
class _LayerReady:
    request_id: str
    layer: int
    kv_view: torch.Tensor
    traced: kv_traces.TracedTransfer | None = None  # a sampled trace's; None: untraced
    arrived: float = 0.0


@dataclass(frozen=True, slots=True)
class _Complete:
    request_id: str
    first_token_id: int


@dataclass(frozen=True, slots=True)
class _Failed:
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class _Restart:
    request_id: str
    reason: str
    done: threading.Event  # set by the injector thread; the receiver thread waits on it


@dataclass(frozen=True, slots=True)
class _Forget:
    request_id: str
    done: asyncio.Future[None]  # forget()'s own future, resolved on its event loop


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


_Item = _LayerReady | _Complete | _Failed | _Restart | _Forget | _Stop


class KVInjector(KVReceiveListener):
    """One per decode pod; `kv_caches` are the engine's per-layer cache tensors."""

    def __init__(self, kv_caches: list[torch.Tensor], metrics: PodMetrics, *,
                 kernel_backend: Backend | str = Backend.AUTO,
                 clock: Callable[[], float] = time.monotonic,
                 eta: TransferETA | None = None) -> None:
        """`kernel_backend`: the engine's (`EngineConfig.kernel_backend`), for the
        scatter. `clock`: read on the injector thread once per layer and once
        per END (tests pass their own). `eta`: told of every request's layers
        and END, with those times (None: nobody asks when transfers end)."""
        self._caches = kv_caches
        self._kernel_backend = Backend.parse(kernel_backend)
        self._metrics = metrics
        self._device = kv_caches[0].device
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self._items: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}  # injector thread only (after expect)
        self._lock = threading.Lock()  # guards _pending between expect and the thread
        self._eta = eta
        self._clock = clock
        self._thread = threading.Thread(target=self._run, name="kv-injector", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- KVImport (event loop)

    def expect(self, request_id: str, slot_mapping: torch.Tensor, num_layers: int,
               num_bytes: int, on_ready: Callable[[int], object] | None = None, *,
               split: SplitHead | None = None) -> asyncio.Future[int]:
        """Register R before its receiver ticket exists, so no layer can
        arrive unannounced. The future resolves with the first token id once
        every layer is in the cache, or raises TransferFailed.

        `on_ready(first_token_id)` runs on the injector thread the moment R's
        KV is complete (every layer in, END accepted, on CUDA the copies
        done), before the future resolves; if it raises, R fails with the
        reason. After it the injector never touches R again (no `forget`
        needed).

        A split prefill's head (`split`): its gate is marked after each
        layer is in (on CUDA, its copy done), and the tail starts after
        layer 0. A restart fails R (the tail may have read the layers it
        would overwrite), and so does `forget` before R settled: the gate
        opens either way (decode_service/split_head.py)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        with self._lock:
            if request_id in self._pending:
                raise ValueError(f"request {request_id!r} is already waiting for KV")
            self._pending[request_id] = _Pending(slot_mapping, num_layers, num_bytes, future, loop,
                                                 on_ready, split)
        return future

    async def forget(self, request_id: str) -> None:
        """Drop R; returns once the injector thread will never touch it again."""
        done = asyncio.get_running_loop().create_future()
        self._items.put(_Forget(request_id, done))
        await done

    def close(self) -> None:
        self._items.put(_Stop())
        self._thread.join(timeout=5)

    # ---------------------------------------------------------------- receiver threads

    def on_layer_ready(self, request_id: str, layer: int, kv_view: torch.Tensor) -> None:
        traced = kv_traces.traced(request_id)  # tracing off: an empty map, nothing read
        if traced is None:
            self._items.put(_LayerReady(request_id, layer, kv_view))
        else:
            self._items.put(_LayerReady(request_id, layer, kv_view, traced, self._clock()))

    def on_complete(self, request_id: str, first_token_id: int) -> None:
        self._items.put(_Complete(request_id, first_token_id))

    def on_failed(self, request_id: str, reason: str) -> None:
        self._items.put(_Failed(request_id, reason))

    def on_restart(self, request_id: str, reason: str) -> None:
        """Blocks until the injector thread dealt with every layer queued before
        (and, on CUDA, their copies finished): the receiver lets the next attempt
        write the landing buffer only after this returns. Bounded, so a wedged
        injector cannot hold a receiver thread forever."""
        done = threading.Event()
        self._items.put(_Restart(request_id, reason, done))
        if not done.wait(_RESTART_WAIT_S):
            raise RuntimeError(f"injector did not reach the restart of {request_id} in "
                               f"{_RESTART_WAIT_S:g}s")

    # ---------------------------------------------------------------- injector thread

    def _run(self) -> None:
        while True:
            item = self._items.get()
            p: _Pending | None = None
            if isinstance(item, _Stop):
                return
            try:
                if isinstance(item, _Forget):
                    self._forget(item)
                    continue
                if isinstance(item, _Restart):
                    self._restart(item.request_id, item.reason, item.done)
                    continue
                with self._lock:
                    p = self._pending.get(item.request_id)
                if p is None or p.settled:
                    continue
                if isinstance(item, _LayerReady):
                    self._inject(item.request_id, p, item.layer, item.kv_view)
                    if item.traced is not None:  # a sampled trace: the layer's times
                        item.traced.layer_in(item.layer, item.kv_view.nbytes, item.arrived,
                                             self._clock())
                elif isinstance(item, _Complete):
                    self._complete(item.request_id, p, item.first_token_id)
                else:
                    self._fail(item.request_id, p, item.reason)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop injection
                log.exception("KV injection of %s failed", item.request_id)
                if p is not None and not p.settled:
                    self._fail(item.request_id, p, f"injection: {exc}")

    def _fail(self, request_id: str, p: _Pending, reason: str) -> None:
        if self._eta is not None:
            self._eta.forget(request_id)
        p.fail(TransferFailed(request_id, reason))

    def _forget(self, item: _Forget) -> None:
        if self._stream is not None:
            # queued H2D copies may still read the landing buffer
            self._stream.synchronize()
        with self._lock:
            p = self._pending.pop(item.request_id, None)
        if self._eta is not None:
            self._eta.forget(item.request_id)
        if p is not None and p.split is not None and not p.settled:
            p.split.lost()  # a tail still waiting for layers that will not come
        item.done.get_loop().call_soon_threadsafe(_resolve, item.done, None)

    def _inject(self, request_id: str, p: _Pending, layer: int, view: torch.Tensor) -> None:
        if layer != p.layers_done:
            raise RuntimeError(f"layer {layer} arrived, expected layer {p.layers_done}")
        now = self._clock()
        if p.first_layer_at is None:
            p.first_layer_at = now
        if self._stream is None:
            kernels.inject_kv(self._caches[layer], view, p.slot_mapping,
                              backend=self._kernel_backend)
        else:
            if layer == 0:
                # the slot mapping was written on the engine's stream at reserve time
                self._stream.wait_stream(torch.cuda.default_stream(self._device))
            with torch.cuda.stream(self._stream):
                src = view.to(self._device, non_blocking=True)
                kernels.inject_kv(self._caches[layer], src, p.slot_mapping,
                                  backend=self._kernel_backend)
        p.layers_done += 1
        if self._eta is not None:
            self._eta.layer_in(request_id, p.layers_done, p.num_layers, now)
        p.to(InjectState.INJECTING)
        if p.split is not None:
            if self._stream is not None:
                self._stream.synchronize()  # the engine's stream reads it next
            p.split.layer_in(p.layers_done)

    def _restart(self, request_id: str, reason: str, done: threading.Event) -> None:
        try:
            if self._stream is not None:
                self._stream.synchronize()  # queued H2D copies may read the old views
            with self._lock:
                p = self._pending.get(request_id)
            if p is not None and p.split is not None and not p.settled:
                # a split's tail may have read the layers a restart overwrites
                self._fail(request_id, p, SplitHead.restart_reason(reason))
            elif p is not None and p.state in (InjectState.WAITING, InjectState.INJECTING):
                log.info("KV of %s restarts from layer 0 (%s)", request_id, reason)
                if p.state is InjectState.INJECTING:
                    p.to(InjectState.WAITING)
                p.layers_done = 0
                p.first_layer_at = None
                if (traced := kv_traces.traced(request_id)) is not None:
                    traced.restart()  # the layers come again: one event each
                if self._eta is not None:
                    self._eta.forget(request_id)
        finally:
            done.set()

    def _complete(self, request_id: str, p: _Pending, first_token_id: int) -> None:
        if p.layers_done != p.num_layers:
            raise RuntimeError(f"END after {p.layers_done} of {p.num_layers} layers")
        if self._stream is not None:
            # The engine's stream must never read these slots before the
            # scatter finished; wait here, on the injector thread.
            self._stream.synchronize()
        now = self._clock()
        if self._eta is not None:
            self._eta.ended(request_id, now)  # its commit is about to be queued
        if p.on_ready is not None:
            p.on_ready(first_token_id)  # before anything else: the engine's next step
        with self._lock:
            self._pending.pop(request_id, None)
        if p.first_layer_at is not None:
            self._metrics.kv_injection_seconds.observe(now - p.first_layer_at)
        self._metrics.kv_transfer_bytes.inc(p.num_bytes)
        p.ready(first_token_id)


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

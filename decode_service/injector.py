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
from engine.layer_gate import LayerGate
from engine.metrics import PodMetrics
from kernels.dispatch import Backend
from kv_transfer.base import KVReceiveListener
from proto.reasons import SPLIT_HEAD_LOST

log = logging.getLogger(__name__)
_RESTART_WAIT_S = 30.0
# END's lag behind the last layer, in layers' cadences (the last layer's MLP,
# the final norm and sampling, the wire): where the learnt average starts,
# and the weight of each request in it (`KVInjector.next_ready`)
_END_LAG_START = 1.0
_END_LAG_ALPHA = 0.2
_END_LAG_MAX = 2.0  # one stalled END does not push every later expectation out


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
    # a split prefill's head (engine.layer_gate): marked as layers land;
    # `on_first_layer` starts the engine's tail once layer 0 is in
    gate: LayerGate | None = None
    on_first_layer: Callable[[], object] | None = None
    state: InjectState = InjectState.WAITING
    layers_done: int = 0
    first_layer_at: float | None = None
    # when END is expected (monotonic), from the layers' cadence; None before
    # two layers are in and once the commit is queued (`KVInjector.next_ready`)
    expected_at: float | None = None
    last_layer_at: float = 0.0
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
        if self.gate is not None:
            self.gate.fail()
        self.to(InjectState.FAILED)
        self.reason = exc.reason
        self.expected_at = None
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
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`kernel_backend`: the engine's (`EngineConfig.kernel_backend`), for the
        scatter. `clock`: read on the injector thread once per layer and once
        per END (tests pass their own)."""
        self._caches = kv_caches
        self._kernel_backend = Backend.parse(kernel_backend)
        self._metrics = metrics
        self._device = kv_caches[0].device
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self._items: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}  # injector thread only (after expect)
        self._lock = threading.Lock()  # guards _pending between expect and the thread
        self._end_lag = _END_LAG_START  # injector thread only
        self._clock = clock
        self._thread = threading.Thread(target=self._run, name="kv-injector", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- KVImport (event loop)

    def expect(self, request_id: str, slot_mapping: torch.Tensor, num_layers: int,
               num_bytes: int, on_ready: Callable[[int], object] | None = None, *,
               gate: LayerGate | None = None,
               on_first_layer: Callable[[], object] | None = None
               ) -> asyncio.Future[int]:
        """Register R before its receiver ticket exists, so no layer can
        arrive unannounced. The future resolves with the first token id once
        every layer is in the cache, or raises TransferFailed.

        `on_ready(first_token_id)` runs on the injector thread the moment R's
        KV is complete (every layer in, END accepted, on CUDA the copies
        done), before the future resolves; if it raises, R fails with the
        reason. After it the injector never touches R again (no `forget`
        needed).

        A split prefill's head (`gate`): after each layer is in (on CUDA,
        its copy done) the gate is marked, and after layer 0
        `on_first_layer()` starts the engine's tail. A restart fails R (the
        tail may have read the layers it would overwrite), and so does
        `forget` before R settled: the gate opens either way."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        with self._lock:
            if request_id in self._pending:
                raise ValueError(f"request {request_id!r} is already waiting for KV")
            self._pending[request_id] = _Pending(slot_mapping, num_layers, num_bytes, future, loop,
                                                 on_ready, gate, on_first_layer)
        return future

    async def forget(self, request_id: str) -> None:
        """Drop R; returns once the injector thread will never touch it again."""
        done = asyncio.get_running_loop().create_future()
        self._items.put(_Forget(request_id, done))
        await done

    def close(self) -> None:
        self._items.put(_Stop())
        self._thread.join(timeout=5)

    # ---------------------------------------------------------------- engine loop thread

    def next_ready(self) -> tuple[str, float] | None:
        """The pending request expected to complete first and when
        (`time.monotonic()`), or None. The expectation extrapolates the
        cadence of its injected layers to the rest, plus END's lag behind
        the last layer (the prefill pod's last MLP, its sampling of the first
        token, the wire; learnt from earlier requests in cadences), so it
        exists once two layers are in. The engine loop may hold a step's
        start for it (`EngineLoop.join_transfers`)."""
        best: tuple[str, float] | None = None
        with self._lock:
            for request_id, p in self._pending.items():
                at = p.expected_at
                if at is not None and (best is None or at < best[1]):
                    best = (request_id, at)
        return best

    # ---------------------------------------------------------------- receiver threads

    def on_layer_ready(self, request_id: str, layer: int, kv_view: torch.Tensor) -> None:
        self._items.put(_LayerReady(request_id, layer, kv_view))

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
                    self._inject(p, item.layer, item.kv_view)
                elif isinstance(item, _Complete):
                    self._complete(item.request_id, p, item.first_token_id)
                else:
                    p.fail(TransferFailed(item.request_id, item.reason))
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop injection
                log.exception("KV injection of %s failed", item.request_id)
                if p is not None and not p.settled:
                    p.fail(TransferFailed(item.request_id, f"injection: {exc}"))

    def _forget(self, item: _Forget) -> None:
        if self._stream is not None:
            # queued H2D copies may still read the landing buffer
            self._stream.synchronize()
        with self._lock:
            p = self._pending.pop(item.request_id, None)
        if p is not None and p.gate is not None and not p.settled:
            p.gate.fail()  # a tail still waiting for layers that will not come
        item.done.get_loop().call_soon_threadsafe(_resolve, item.done, None)

    def _inject(self, p: _Pending, layer: int, view: torch.Tensor) -> None:
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
        p.last_layer_at = now
        if p.layers_done >= 2:
            per_layer = _cadence(p)
            p.expected_at = now + per_layer * (p.num_layers - p.layers_done + self._end_lag)
        p.to(InjectState.INJECTING)
        if p.gate is not None:
            if self._stream is not None:
                self._stream.synchronize()  # the engine's stream reads it next
            p.gate.mark(p.layers_done)
            if p.layers_done == 1 and p.on_first_layer is not None:
                p.on_first_layer()

    def _restart(self, request_id: str, reason: str, done: threading.Event) -> None:
        try:
            if self._stream is not None:
                self._stream.synchronize()  # queued H2D copies may read the old views
            with self._lock:
                p = self._pending.get(request_id)
            if p is not None and p.gate is not None and not p.settled:
                # a split's tail may have read the layers a restart overwrites
                p.fail(TransferFailed(request_id, f"{SPLIT_HEAD_LOST} ({reason})"))
            elif p is not None and p.state in (InjectState.WAITING, InjectState.INJECTING):
                log.info("KV of %s restarts from layer 0 (%s)", request_id, reason)
                if p.state is InjectState.INJECTING:
                    p.to(InjectState.WAITING)
                p.layers_done = 0
                p.first_layer_at = None
                p.expected_at = None
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
        if p.layers_done >= 2 and (per_layer := _cadence(p)) > 0:
            lag = (now - p.last_layer_at) / per_layer
            self._end_lag += _END_LAG_ALPHA * (min(lag, _END_LAG_MAX) - self._end_lag)
        p.expected_at = None  # its commit is about to be queued: nothing to wait for
        if p.on_ready is not None:
            p.on_ready(first_token_id)  # before anything else: the engine's next step
        with self._lock:
            self._pending.pop(request_id, None)
        if p.first_layer_at is not None:
            self._metrics.kv_injection_seconds.observe(now - p.first_layer_at)
        self._metrics.kv_transfer_bytes.inc(p.num_bytes)
        p.ready(first_token_id)


def _cadence(p: _Pending) -> float:
    """Seconds between R's injected layers so far (two or more in)."""
    assert p.first_layer_at is not None
    return (p.last_layer_at - p.first_layer_at) / (p.layers_done - 1)


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

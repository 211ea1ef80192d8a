"""`KVImport`: one remote-prefilled request's KV import on a decode pod, the
counterpart of the prefill pod's `KVExport` (prefill_service/kv_export.py).

Three parties hold a piece of request R until its KV is in the cache: the
engine loop (R's reserved blocks), the receiver (R's landing buffer and
ticket) and the injector (R's slot mapping, written from the injector
thread). A `KVImport` takes them in order and gives them back in the one
order that is safe, so no writer can touch a block after the engine freed it.

Life of one import (R), every method called by R's `Generate` coroutine on
the pod's event loop unless another caller is named:

    NEW
     │ reserve()      engine loop: reserve_remote(R); blocks for context +
     v                max_tokens held, R in WAITING_FOR_REMOTE_KV; with the pod's
     │                prefix cache on, its cached prefix (whole blocks) is held too
     │                and only the rest is expected (cache-miss-only transfer)
    RESERVING ─ CapacityError / ValueError ─> (nothing held; the error propagates)
     │        ─ a local rule holds (engine/local_rule.py) ─> LOCAL: the engine
     │          computes R itself (conditional disaggregation); R's tokens come
     v          on `stream` from index 0, and nothing is held here
    RESERVED
     │ open()         injector.expect(R) (before any ticket exists, so no layer
     v                arrives unannounced), then receiver.expect(R) -> landing
    OPEN              buffer + ticket: the target sent to the prefill pod
     │ wait()         receiver I/O threads land each layer; the injector thread
     │                writes it into R's slots while the engine keeps stepping;
     │                a lost sender restarts the layers (injector.on_restart)
     │   transfer failed -> TransferFailed(reason); no KV by the deadline (per
     │   phase: no BEGIN within the reservation timeout -- the prefill may be
     │   queued --, or no END within the transfer timeout of the BEGIN) ->
     │   TransferFailed("deadline: ..."); abort() (the Abort RPC, same event
     │   loop) -> RequestAborted -- R stays OPEN until free()
     v
    INJECTED          every layer in the cache and END accepted: the injector
     │                thread has already queued commit_remote(R, first token)
     │                on the engine loop (so R joins the engine's next step
     │                without waiting for this event loop) and let go of R
     │ commit()       receiver.release(R) (landing freed), then await that
     v                queued commit
    COMMITTED         R runs in the batch; the engine alone owns it from here

    A split prefill (`open(split_at)`, docs/architecture.md "One prompt
    on both pods"): only the head [held, split_at) comes over the wire; after
    its layer 0 the injector thread queues `start_tail` instead of, at the
    end, `commit_remote`, and the engine computes the tail behind the
    injector and samples token 0 itself, into `stream`. INJECTED and
    COMMITTED mean the same as above; the servicer sends R's tokens only
    from COMMITTED on, so a token computed over a head that never arrived
    whole is never sent (the engine aborts such a request itself).

    A decode pod at TP=b > 1 (`RemoteKV.ranks`, decode_service/rank_links.py):
    every rank lands and injects only its own KV heads. open() also sends
    each worker rank EXPECT (its heads' layout, the same deadline, so its
    receiver issues the same ticket) and the target lists every rank's
    endpoints and heads; R is INJECTED only when rank 0's own injection and
    every worker's LANDED are in (any FAILED fails R), and only then does
    this class queue R's commit (rank 0's injector queues nothing). free()
    has every worker forget R (FORGOTTEN from each) before the engine frees
    R's blocks. No split prefill at TP > 1 (`split_for` takes none: the tail
    would compute beside the steps' collectives).

    RESERVED / OPEN / INJECTED ── free(reason) ──> FREED
        (cancel, Abort, failure, deadline, a commit that raised): the receiver
        stops writing (cancel), the injector lets go of R (forget returns once
        its thread never touches R again), the landing buffer is released, and
        only then the engine aborts R and frees its blocks.

Who sets what: the injector owns the future that says R's KV is in (set on
its thread via `call_soon_threadsafe`); the engine loop the future of the
commit the injector thread queued (`_queue_commit`); this class owns the
future `abort` sets; the caller never sets any. A commit queued just before an
`abort` or `free` is harmless: the engine runs commands in order, so the
abort that `free` queues still finds R and frees it.

A `Generate` cancelled inside `reserve()` (its command still queued behind
a step, or run but its answer unread) leaves R in RESERVING and holds
nothing: `EngineLoop.reserve_remote` skips the command or undoes it on the
loop thread (engine/engine_loop.py, `_admit`).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from decode_service.injector import KVInjector, TransferFailed
from decode_service.rank_links import DecodeRanks
from decode_service.rank_wire import rank_layout
from decode_service.split_head import SplitHead
from engine.engine_loop import EngineLoop
from engine.layer_gate import LayerGate
from engine.outputs import RemoteReservation
from engine.request_stream import RequestAborted, RequestStream
from engine.sampling_params import SamplingParams
from kv_transfer.base import KVLayout, KVReceiver, TransferTarget
from pod.kv_shape import KVShape

# Past the transfer deadline the receiver's sweeper fails the transfer
# itself; this slack only covers its sweep interval before we give up locally.
_DEADLINE_SLACK_S = 1.0


@dataclass(frozen=True, slots=True)
class RemoteKV:
    """The decode pod's receive side; None on a colocated pod.

    Deadlines per phase: a reserved request waits for a prefill pod to begin
    sending for up to `reservation_timeout_s` (its prefill may be queued);
    each sending attempt must finish within `transfer_timeout_s` of its BEGIN."""

    receiver: KVReceiver
    injector: KVInjector
    kv_shape: KVShape
    transfer_timeout_s: float
    reservation_timeout_s: float = 600.0
    ranks: DecodeRanks | None = None  # the worker ranks of a pod at TP > 1
    # how long free() waits for the worker ranks to forget a request
    forget_timeout_s: float = 60.0


class ImportState(enum.Enum):
    NEW = "new"
    RESERVING = "reserving"
    RESERVED = "reserved"
    LOCAL = "local"
    OPEN = "open"
    INJECTED = "injected"
    COMMITTED = "committed"
    FREED = "freed"


_IMPORT_TRANSITIONS = {
    ImportState.NEW: frozenset({ImportState.RESERVING}),
    ImportState.RESERVING: frozenset({ImportState.RESERVED, ImportState.LOCAL}),
    ImportState.RESERVED: frozenset({ImportState.OPEN, ImportState.FREED}),
    ImportState.OPEN: frozenset({ImportState.INJECTED, ImportState.FREED}),
    ImportState.INJECTED: frozenset({ImportState.COMMITTED, ImportState.FREED}),
    ImportState.COMMITTED: frozenset(),
    ImportState.LOCAL: frozenset(),
    ImportState.FREED: frozenset(),
}

# What `free` must give back: blocks, and maybe an injector entry and a landing buffer.
_HOLDING = (ImportState.RESERVED, ImportState.OPEN, ImportState.INJECTED)


class KVImport:
    """One request's import; see the module docstring for the life cycle."""

    def __init__(self, request_id: str, loop: EngineLoop, remote: RemoteKV) -> None:
        self.request_id = request_id
        self._loop = loop
        self._remote = remote
        self._state = ImportState.NEW
        self._reservation: RemoteReservation | None = None
        self._stream: RequestStream | None = None
        self._ready: asyncio.Future[int] | None = None  # the injector's
        self._committed: asyncio.Future[None] | None = None  # the engine loop's, see _queue_commit
        self._aborted: asyncio.Future[RequestAborted] | None = None  # ours: abort()
        self._own_ready: asyncio.Future[int] | None = None  # TP > 1: rank 0's injector's
        self._expecting: asyncio.Future[None] | None = None  # TP > 1: DecodeRanks'

    @property
    def state(self) -> ImportState:
        return self._state

    @property
    def holds_resources(self) -> bool:
        """True while R holds what only `free` gives back (a cancelled
        `reserve` is undone by the engine loop itself)."""
        return self._state in _HOLDING

    def _to(self, new: ImportState) -> None:
        if new not in _IMPORT_TRANSITIONS[self._state]:
            raise RuntimeError(f"import state {self._state.value} -> {new.value} is not allowed")
        self._state = new

    async def reserve(self, prompt: Sequence[int], params: SamplingParams,
                      outputs: Sequence[int], local_prefill_below: int = 0,
                      prefill_cached_tokens: int | None = None
                      ) -> RemoteReservation | None:
        """Hold R's blocks; CapacityError / ValueError propagate (nothing held).
        None: a conditional-disaggregation rule (engine/local_rule.py) had
        the engine compute R itself (LOCAL; its tokens arrive on `stream`
        from index 0)."""
        self._to(ImportState.RESERVING)
        self._reservation, self._stream = await self._loop.reserve_remote(
            self.request_id, prompt, params, output_token_ids=outputs,
            local_prefill_below=local_prefill_below,
            prefill_cached_tokens=prefill_cached_tokens)
        self._to(ImportState.LOCAL if self._reservation is None else ImportState.RESERVED)
        return self._reservation

    @property
    def stream(self) -> RequestStream:
        """R's output stream (after `reserve`)."""
        assert self._stream is not None
        return self._stream

    @property
    def held_bytes(self) -> int:
        """KV bytes of the cached prefix the pod holds, which nobody sends."""
        held = 0 if self._reservation is None else self._reservation.num_held_tokens
        return self._remote.kv_shape.bytes_of(held)

    def split_for(self, split_at: int) -> int:
        """The split this pod takes for a requested `split_at` (0 = none):
        none when its cached prefix already holds the head, or when the tail
        would not fit its inter-token budget beside the running batch."""
        assert self._reservation is not None
        if self._remote.ranks is not None:
            return 0  # TP > 1: no split (module docstring)
        if split_at <= self._reservation.num_held_tokens:
            return 0
        # The tail computes beside the running batch: only if it fits the
        # pod's inter-token budget beside the last step's decodes (else the
        # prefill pod computes the whole prompt; docs/router.md, Split prefill).
        budget = self._loop.itl_budget
        tail = self._reservation.num_context_tokens - split_at
        if budget is not None and self._loop.stats.num_running and \
                not budget.fits_beside_last_step(split_at, tail):
            return 0
        return split_at

    def open(self, split_at: int = 0) -> TransferTarget:
        """Announce R to the injector, then open its landing buffer; returns the
        target for the prefill pod. BufferPoolExhausted when the landing pool
        is full (R is still RESERVED then: `free` it).

        `split_at` > 0 (from `split_for`): a split prefill. The prefill pod
        sends context tokens [held, split_at) only; once their layer 0 is in,
        the injector thread queues `start_tail` on the engine loop, and the
        engine computes the rest layer by layer behind the injector
        (engine.layer_gate). R's tokens, token 0 included, come on `stream`."""
        assert self._reservation is not None
        remote = self._remote
        reservation = self._reservation
        held = reservation.num_held_tokens
        head = split_at - held if split_at else reservation.num_new_tokens
        layout = remote.kv_shape.layout(head, held)
        event_loop = asyncio.get_running_loop()
        deadline = time.time() + remote.reservation_timeout_s
        if remote.ranks is not None:
            return self._open_ranks(remote.ranks, layout, deadline, event_loop)
        if split_at:
            gate = LayerGate(layout.num_layers)
            split = SplitHead(gate, lambda: self._queue_tail(split_at, gate, event_loop))
            self._ready = remote.injector.expect(
                self.request_id, reservation.slot_mapping[:head], layout.num_layers,
                layout.total_bytes, split=split)
        else:
            self._ready = remote.injector.expect(
                self.request_id, reservation.slot_mapping, layout.num_layers,
                layout.total_bytes, on_ready=lambda token: self._queue_commit(token, event_loop))
        self._aborted = event_loop.create_future()
        target = remote.receiver.expect(self.request_id, layout, deadline,
                                        transfer_timeout_s=remote.transfer_timeout_s)
        self._to(ImportState.OPEN)
        return target

    def _open_ranks(self, ranks: DecodeRanks, layout: KVLayout, deadline: float,
                    event_loop: asyncio.AbstractEventLoop) -> TransferTarget:
        """`open` at TP > 1: the workers expect their heads first, then rank
        0 its own; `_ready` resolves when all are in, having queued the commit."""
        remote, reservation = self._remote, self._reservation
        own = remote.injector.expect(self.request_id, reservation.slot_mapping,
                                     layout.num_layers, rank_layout(layout, *ranks.head_range(0))
                                     .total_bytes)
        landing = ranks.expect(self.request_id, layout, deadline, remote.transfer_timeout_s,
                               reservation.slot_mapping)
        self._own_ready, self._expecting = own, landing.expecting
        self._ready = event_loop.create_task(self._all_landed(own, landing.landed, event_loop))
        self._aborted = event_loop.create_future()
        target = remote.receiver.expect(self.request_id, rank_layout(layout,
                                                                     *ranks.head_range(0)),
                                        deadline, transfer_timeout_s=remote.transfer_timeout_s)
        self._to(ImportState.OPEN)
        return replace(target, ranks=ranks.targets, tensor_parallel_size=ranks.size)

    async def ranks_expecting(self) -> None:
        """After `open`, before R's target goes out: at TP > 1 every worker
        rank expects R (else a sender could reach a rank that refuses R as
        unknown). TransferFailed when a rank could not expect R."""
        if self._expecting is not None:
            await asyncio.wait_for(asyncio.shield(self._expecting), self._remote.forget_timeout_s)

    async def _all_landed(self, own: asyncio.Future[int], landed: asyncio.Future[int],
                          event_loop: asyncio.AbstractEventLoop) -> int:
        """Rank 0's first token once its own injection and every worker's
        LANDED are in (the first failure wins); R's commit queued."""
        await asyncio.wait((own, landed), return_when=asyncio.FIRST_EXCEPTION)
        for future in (own, landed):
            if future.done() and not future.cancelled() and future.exception() is not None:
                raise future.exception()
        first_token_id = own.result()
        if landed.result() != first_token_id:
            raise TransferFailed(self.request_id, f"aborted: rank 0 landed first token "
                                                  f"{first_token_id}, the workers "
                                                  f"{landed.result()}")
        self._queue_commit(first_token_id, event_loop)
        return first_token_id

    async def wait(self) -> int:
        """R's first token once every layer is in its slots and END was
        accepted. Raises TransferFailed (the receiver's or the injector's
        reason, or the deadline) or RequestAborted (`abort` came first)."""
        if self._state is not ImportState.OPEN:
            raise RuntimeError(f"wait() in import state {self._state.value}")
        assert self._ready is not None and self._aborted is not None
        # The receiver enforces the per-phase deadlines (RemoteKV); every one
        # ends by the reservation's, so that is where this local backstop waits.
        timeout_s = self._remote.reservation_timeout_s
        # neither future is cancelled by a timeout or by our caller's cancel
        await asyncio.wait((self._ready, self._aborted), timeout=timeout_s + _DEADLINE_SLACK_S,
                           return_when=asyncio.FIRST_COMPLETED)
        if self._aborted.done():
            raise self._aborted.result()
        if not self._ready.done():
            raise TransferFailed(self.request_id, f"deadline: no KV within the "
                                                  f"{timeout_s:g}s reservation timeout")
        first_token_id = self._ready.result()  # raises the injector's TransferFailed
        self._to(ImportState.INJECTED)
        return first_token_id

    def abort(self, reason: str) -> None:
        """The Abort RPC (event loop): fail R's `wait` with RequestAborted,
        unless its KV is already in. R's own coroutine then `free`s it."""
        if (self._state is ImportState.OPEN and self._ready is not None
                and not self._ready.done() and self._aborted is not None
                and not self._aborted.done()):
            self._aborted.set_result(RequestAborted(self.request_id, reason))

    def _queue_commit(self, first_token_id: int, event_loop: asyncio.AbstractEventLoop) -> None:
        """Injector thread, the moment R's KV is complete: R joins the engine's
        next step. Raises EngineDead when the loop stopped (R then fails)."""
        rid = self.request_id
        self._committed = self._loop.submit(
            lambda engine: engine.commit_remote(rid, first_token_id), event_loop)

    def _queue_tail(self, split_at: int, gate: LayerGate,
                    event_loop: asyncio.AbstractEventLoop) -> None:
        """Injector thread, once the head's layer 0 is in: the engine computes
        R's tail from its next step on, each layer behind the injector; the
        tail worker wakes the loop when it is done."""
        rid, loop = self.request_id, self._loop
        self._committed = loop.submit(
            lambda engine: engine.start_tail(rid, split_at, gate, on_done=loop.wake), event_loop)

    async def commit(self) -> RequestStream:
        """R's KV is in the cache and its commit queued (see `_queue_commit`,
        or `_queue_tail` for a split, whose tail may have run already): the
        landing buffer is done; returns the stream R's tokens arrive on once
        the command ran (its error, e.g. a first token outside the
        vocabulary, propagates)."""
        if self._state is not ImportState.INJECTED:
            raise RuntimeError(f"commit() in import state {self._state.value}")
        assert self._stream is not None and self._committed is not None
        self._remote.receiver.release(self.request_id)
        await self._committed
        self._to(ImportState.COMMITTED)
        return self._stream

    async def free(self, reason: str) -> None:
        """R ended before commit (`reason`: "client", "abort_rpc", "transfer"):
        give everything back in the safe order. Each step is a no-op for what
        R no longer holds. Callers shield it from cancellation."""
        if not self.holds_resources:
            return
        self._to(ImportState.FREED)
        remote = self._remote
        if isinstance(self._ready, asyncio.Task):
            self._ready.cancel()  # TP > 1: it must not queue a commit after the abort below
        remote.receiver.cancel(self.request_id, f"decode request ended before commit ({reason})")
        await remote.injector.forget(self.request_id)
        if remote.ranks is not None:  # every worker stops writing R's slots first
            await remote.ranks.forget(self.request_id, remote.forget_timeout_s)
        for future in (self._ready, self._committed, self._own_ready, self._expecting):
            if future is not None and future.done() and not future.cancelled():
                future.exception()  # a late outcome nobody waits for any more: seen
        remote.receiver.release(self.request_id)
        await self._loop.abort(self.request_id, reason)

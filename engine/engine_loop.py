"""`EngineLoop`: the one thread that owns an `LLMEngine`, shared by the
prefill, decode and colocated pods.

Threads and who calls what:

* the **engine-loop thread** (started by `start()`) is the only thread that
  touches the engine: it runs queued commands, then `engine.step()` while the
  engine has work, and otherwise sleeps on the command queue. It never waits
  on the network: the prefill pod's layer hook only hands tensors to a
  sender thread, the decode pod's injector runs on its own thread.
* the **asyncio loop** of the gRPC server calls the `async` methods below
  (`add_request`, `abort`, `reserve_remote`, `commit_remote`, `run`). Each
  queues a command and awaits its result, so a servicer never blocks the
  event loop on the engine.
* any thread may read `stats` (an immutable snapshot replaced after every
  step) and call `kv_caches()` (the cache tensors never move after start).

Outputs travel back per request: `add_request` / `reserve_remote` register a
`RequestStream` (an asyncio queue on the servicer's loop) *before* the
engine sees the request, so no output can be lost; after each step the loop
thread pushes each request's outputs with one `call_soon_threadsafe` per
step. A stream ends with the request's finished output, with
`RequestAborted` when it is aborted, or with `EngineDead` if `step()` raised
(the pod then reports NOT_SERVING; there is no recovering a half-stepped
engine).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from engine.metrics import PodMetrics
from engine.outputs import EngineStats, RemoteReservation, RequestOutput

if TYPE_CHECKING:  # the loop only calls the engine; importing it would load the model code
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long the idle loop sleeps on the command queue before re-checking the
# stop flag; commands wake it at once, so this only bounds shutdown latency.
_IDLE_POLL_S = 0.5


class LoopState(enum.Enum):
    """NEW -> RUNNING -> STOPPED, or RUNNING -> DEAD when `step()` raised."""

    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"
    DEAD = "dead"


_TRANSITIONS: dict[LoopState, frozenset[LoopState]] = {
    LoopState.NEW: frozenset({LoopState.RUNNING, LoopState.STOPPED}),
    LoopState.RUNNING: frozenset({LoopState.STOPPED, LoopState.DEAD}),
    LoopState.DEAD: frozenset({LoopState.STOPPED}),
    LoopState.STOPPED: frozenset(),
}


class RequestAborted(Exception):
    """Raised by a `RequestStream` whose request was aborted; `reason` is the
    short word the abort was counted under ("client", "deadline", ...)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id} aborted ({reason})")
        self.request_id = request_id
        self.reason = reason


class EngineDead(RuntimeError):
    """The engine loop stopped (its `step()` raised, or the pod shut down)."""


class RequestStream:
    """The outputs of one request, read by one servicer coroutine with
    `async for`. Created on the servicer's event loop; fed by the loop thread
    through `call_soon_threadsafe` only."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.closed = False  # set by the loop thread once the last item is queued
        # Set on the event loop when the request is aborted: outputs the engine
        # produced before the abort and still queued are dropped, so a reader
        # sees nothing after the abort it (or anyone) awaited.
        self._aborted: RequestAborted | None = None

    def _push_threadsafe(self, item: RequestOutput | BaseException) -> None:
        _call_soon(self._loop, self._queue.put_nowait, item)

    def _abort_threadsafe(self, exc: RequestAborted) -> None:
        def abort() -> None:
            self._aborted = exc
            self._queue.put_nowait(exc)  # wakes a reader blocked on get()

        _call_soon(self._loop, abort)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._queue.get()
            if self._aborted is not None:
                raise self._aborted
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


class EngineLoop:
    """Owns `engine` (an `engine.llm_engine.LLMEngine`) on one thread; see the
    module docstring for the threading contract. `metrics` gauges are updated
    after every step."""

    def __init__(self, engine: LLMEngine, metrics: PodMetrics) -> None:
        self._engine = engine
        self._metrics = metrics
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched by the loop thread only
        self._state = LoopState.NEW
        self._state_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.stats: EngineStats = engine.stats()
        # prefix-cache totals already added to the (delta-only) counters
        self._counted_queries = 0
        self._counted_hits = 0
        self.block_size: int = int(engine.config.block_size)
        self.max_model_len: int = int(engine.max_model_len)

    # ------------------------------------------------------------ lifecycle

    @property
    def state(self) -> LoopState:
        return self._state

    def _transition(self, new: LoopState) -> bool:
        with self._state_lock:
            if new not in _TRANSITIONS[self._state]:
                return False
            self._state = new
            return True

    def start(self) -> None:
        """Start the loop thread (called once by the pod's main)."""
        if not self._transition(LoopState.RUNNING):
            raise RuntimeError(f"engine loop cannot start from state {self._state.value}")
        self._publish_stats()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; open streams end with `EngineDead`.
        Called by the pod's main after the gRPC server stopped."""
        if not self._transition(LoopState.STOPPED):
            return
        self._commands.put(None)  # wake an idle loop
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------ commands (asyncio side)

    async def run(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(engine)` on the loop thread and return its result (or
        raise its exception) on the caller's event loop. Raises EngineDead
        when the loop is not running (also for a command still queued when
        the loop stops)."""
        command = _Command(fn, asyncio.get_running_loop())
        with self._state_lock:  # see _fail_all: nothing is queued after the drain
            if self._state is not LoopState.RUNNING:
                raise EngineDead(f"engine loop is {self._state.value}")
            self._commands.put(command)
        return await command.future

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Any,
        *,
        output_token_ids: Sequence[int] = (),
        prefill_only: bool = False,
    ) -> RequestStream:
        """Queue a request in the engine; its outputs arrive on the returned
        stream. ValueError from the engine (prompt too long, bad params)
        propagates to the caller and nothing stays registered."""
        stream = RequestStream(request_id, asyncio.get_running_loop())

        def add(engine: Any) -> None:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use on this pod")
            self._streams[request_id] = stream
            try:
                engine.add_request(
                    request_id,
                    list(prompt_token_ids),
                    sampling_params,
                    output_token_ids=list(output_token_ids),
                    prefill_only=prefill_only,
                )
            except BaseException:
                del self._streams[request_id]
                raise

        await self.run(add)
        return stream

    async def reserve_remote(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Any,
        *,
        output_token_ids: Sequence[int] = (),
    ) -> tuple[RemoteReservation, RequestStream]:
        """Reserve blocks for a request whose KV a prefill pod will send;
        returns the engine's `RemoteReservation` and the stream its tokens
        will arrive on after `commit_remote`. CapacityError / ValueError
        propagate."""
        stream = RequestStream(request_id, asyncio.get_running_loop())

        def reserve(engine: Any) -> Any:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use on this pod")
            reservation = engine.reserve_remote(
                request_id,
                list(prompt_token_ids),
                sampling_params,
                output_token_ids=list(output_token_ids),
            )
            self._streams[request_id] = stream
            return reservation

        reservation = await self.run(reserve)
        return reservation, stream

    async def commit_remote(self, request_id: str, first_token_id: int) -> None:
        """All KV of a reserved request is in its slots: let it join the batch."""
        await self.run(lambda engine: engine.commit_remote(request_id, first_token_id))

    async def abort(self, request_id: str, reason: str) -> bool:
        """Abort a request in any engine state and free its blocks; its
        stream (if still open) ends with `RequestAborted(reason)`. Returns
        whether the request was known to this loop."""

        def abort(engine: Any) -> bool:
            stream = self._streams.pop(request_id, None)
            engine.abort_request(request_id)
            if stream is not None and not stream.closed:
                stream.closed = True
                stream._abort_threadsafe(RequestAborted(request_id, reason))
            return stream is not None

        found = await self.run(abort)
        if found:
            self._metrics.abort(reason)
        return found

    def kv_caches(self) -> list[Any]:
        """The engine's per-layer KV cache tensors (never reallocated after
        start), for the decode pod's injector thread."""
        return list(self._engine.kv_caches)

    # ------------------------------------------------------------ loop thread

    def _run(self) -> None:
        try:
            while self._state is LoopState.RUNNING:
                self._drain_commands(block=not self._engine.has_unfinished_requests())
                if self._state is not LoopState.RUNNING:
                    break
                if self._engine.has_unfinished_requests():
                    outputs = self._engine.step()
                    # Stats first: a caller woken by its last output must see
                    # the blocks that output's request released.
                    self._publish_stats()
                    self._dispatch(outputs)
        except BaseException as exc:  # noqa: BLE001 - the pod must learn its engine died
            log.exception("engine loop died")
            self._transition(LoopState.DEAD)
            self._fail_all(EngineDead(f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        self._fail_all(EngineDead("engine loop stopped"))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else (
                self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            if command is not None:
                self._execute(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, command: _Command) -> None:
        try:
            result = command.fn(self._engine)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            command.reject(exc)
        else:
            self._publish_stats()  # the caller may read `stats` right after
            command.resolve(result)

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted between the step's start and now
                continue
            if output.finished:
                del self._streams[output.request_id]
                stream.closed = True
            stream._push_threadsafe(output)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.closed = True
            stream._push_threadsafe(exc)
        self._streams.clear()
        # Commands queued before the state changed still owe their callers
        # an answer; `run` queues nothing once the state is not RUNNING.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None:
                command.reject(EngineDead(f"engine loop is {self._state.value}"))

    def _publish_stats(self) -> None:
        stats = self._engine.stats()
        self.stats = stats
        m = self._metrics
        m.requests_waiting.set(stats.num_waiting)
        m.requests_running.set(stats.num_running)
        m.kv_blocks_free.set(stats.num_free_blocks)
        m.kv_blocks_total.set(stats.num_total_blocks)
        # The engine keeps cumulative totals; a Counter only goes up by deltas.
        m.prefix_cache_queries.inc(max(0, stats.prefix_cache_queries - self._counted_queries))
        m.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - self._counted_hits))
        self._counted_queries = stats.prefix_cache_queries
        self._counted_hits = stats.prefix_cache_hits


class _Command:
    """One queued `fn(engine)` call and the caller's future (on its event loop)."""

    __slots__ = ("fn", "loop", "future")

    def __init__(self, fn: Callable[[Any], Any], loop: asyncio.AbstractEventLoop) -> None:
        self.fn = fn
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()

    def resolve(self, value: Any) -> None:
        _call_soon(self.loop, _set_result, self.future, value)

    def reject(self, exc: BaseException) -> None:
        _call_soon(self.loop, _set_exception, self.future, exc)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    # A caller whose event loop already closed (its server shut down) is gone;
    # that must not kill the engine loop thread.
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        log.debug("dropped a result for a closed event loop")


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.cancelled():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.cancelled():
        future.set_exception(exc)



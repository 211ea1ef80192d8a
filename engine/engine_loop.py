"""`EngineLoop`: the one thread that owns an `LLMEngine`, shared by the
prefill, decode and colocated pods.

Threads and who calls what:

* the **engine-loop thread** (started by `start()`) is the only thread that
  touches the engine: it runs queued commands, then `engine.step()` while the
  engine has work, and otherwise sleeps on the command queue. It never waits
  on the network: the prefill pod's layer hook only hands tensors to a
  sender thread, the decode pod's injector runs on its own thread. With
  async scheduling a step is in flight while commands run (the engine keeps
  blocks a step in flight writes out of the pool), and on CPU the forward
  itself (and the layer hook) runs on the engine's forward worker thread.
* the **asyncio loop** of the gRPC server calls the `async` methods below
  (`add_request`, `abort`, `reserve_remote`, `call`). Each
  queues a command and awaits its result, so a servicer never blocks the
  event loop on the engine. A caller of `add_request` / `reserve_remote`
  cancelled before its answer leaves nothing held (`_admit`).
* any other thread may queue a command with `submit` (the decode pod's
  injector commits a request whose KV is in straight from its own thread,
  so the commit joins the next step without a hop through the event loop),
  and call `wake` (a split prefill's tail, done on the engine's tail
  worker, has its request join a step: an idle loop checks at once).
* a `StepHook` given to the constructor runs on the loop thread around
  each step: before it (it may hold the start, running commands
  meanwhile) and after it (its wall time). The decode pod's is its join
  hold (engine/join_hold.py).
* any thread may read `stats` (an immutable snapshot replaced after every
  step) and call `kv_caches()` (the cache tensors never move after start).
* a worker thread (`asyncio.to_thread`) compiles a request's grammar into
  the engine's `GrammarCompiler` cache (thread-safe) before the request is
  queued, so the engine thread never compiles one.

Outputs travel back per request (`engine/request_stream.py`): `add_request`
/ `reserve_remote` register a `RequestStream` (an asyncio queue on the
servicer's loop) in the loop thread's `StreamTable` *before* the engine sees
the request, so no output can be lost; after each step the loop thread
pushes each request's outputs with one `call_soon_threadsafe` per step. A
stream ends with the request's finished output, with `RequestAborted` when
it is aborted, or with `EngineDead` if `step()` raised (the pod then reports
NOT_SERVING and exits 1; there is no recovering a half-stepped engine). A
tensor-parallel rank that exits while the loop is idle takes the same path:
the engine's watchdog wakes the loop (`LLMEngine.on_fatal`), and the next
`step()` raises `TensorParallelError` naming the rank.

Commands (`engine.loop_commands.Command`, one `fn(engine)` call each) wait
in a FIFO `CommandQueue`; the loop thread runs everything queued before each
step.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from engine.loop_commands import Command, CommandQueue, Wake
from engine.metrics import PodMetrics
from engine.outputs import EngineStats, RemoteReservation
from engine.request_stream import EngineDead, RequestAborted, RequestStream, StreamTable
from engine.stats_export import StatsExport
from kernels.omp_pool import release_this_threads_pool

if TYPE_CHECKING:  # the loop only calls the engine; importing it would load the model code
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

T = TypeVar("T")


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


class StepHook(Protocol):
    """What the loop thread calls around each step (`EngineLoop(step_hook=)`;
    the decode pod's `engine.join_hold.JoinHold`). Loop thread only."""

    def before_step(self, wait: Callable[[float], bool]) -> None:
        """Before a step the loop is about to start. May hold the start by
        calling `wait(seconds)`, which runs the commands queued within that
        time (returning once the queue is empty after the first one, or the
        time is up) and returns False once the loop is stopping."""

    def after_step(self, seconds: float) -> None:
        """After each step: its wall time."""


class EngineLoop:
    """Owns `engine` (an `engine.llm_engine.LLMEngine`) on one thread; see the
    module docstring for the threading contract. `metrics` gauges are updated
    after every step; `step_hook` (optional) runs around each step."""

    def __init__(self, engine: LLMEngine, metrics: PodMetrics, *,
                 step_hook: StepHook | None = None) -> None:
        self._engine = engine
        self._metrics = metrics
        self._step_hook = step_hook
        self._commands = CommandQueue()
        self._streams = StreamTable()  # touched by the loop thread only
        self._state = LoopState.NEW
        self._state_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.stats: EngineStats = engine.stats()
        self._export = StatsExport(metrics)  # stats into the pod's metrics
        self.block_size: int = int(engine.config.block_size)
        self.max_model_len: int = int(engine.max_model_len)
        self.device_type: str = engine.device.type  # "cpu" | "cuda"
        self.tensor_parallel_size: int = engine.config.tensor_parallel_size
        engine.on_fatal(self.wake)  # a dead tensor-parallel rank: step() raises why

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
        # This thread built the engine; the loop thread steps it from now on:
        # its OpenMP workers would throttle every team's (kernels/omp_pool.py).
        release_this_threads_pool()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; open streams end with `EngineDead`.
        Called by the pod's main after the gRPC server stopped."""
        if not self._transition(LoopState.STOPPED):
            return
        self.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():  # the workers outlast no step of rank 0's
            self._engine.close()  # a TP pod's workers: STOP, then joined

    def wake(self) -> None:
        """Any thread: an idle loop checks the engine for work (and its own
        state) at once, instead of at its next poll."""
        self._commands.put(Wake())

    # ------------------------------------------------------------ commands (asyncio side)

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(engine)` on the loop thread and return its result (or
        raise its exception) on the caller's event loop. Raises EngineDead
        when the loop is not running (also for a command still queued when
        the loop stops)."""
        command = Command.new(fn)
        with self._state_lock:  # see _fail_all: nothing is queued after the drain
            if self._state is not LoopState.RUNNING:
                raise EngineDead(f"engine loop is {self._state.value}")
            self._commands.put(command)
        return await command.future

    def submit(self, fn: Callable[[Any], T], loop: asyncio.AbstractEventLoop
               ) -> asyncio.Future[T]:
        """`call` for any thread: queue `fn(engine)` now and return the future
        (on `loop`) its result or exception will settle. Raises EngineDead at
        once when the loop is not running. An idle loop wakes at once."""
        command = Command(fn, loop, loop.create_future())
        with self._state_lock:
            if self._state is not LoopState.RUNNING:
                raise EngineDead(f"engine loop is {self._state.value}")
            self._commands.put(command)
        return command.future

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
        await self._compile_grammar(sampling_params)
        stream = RequestStream(request_id, asyncio.get_running_loop())

        def add(engine: Any) -> None:
            self._streams.add(stream)
            try:
                engine.add_request(
                    request_id,
                    list(prompt_token_ids),
                    sampling_params,
                    output_token_ids=list(output_token_ids),
                    prefill_only=prefill_only,
                )
            except BaseException:
                self._streams.discard(stream)
                raise

        await self._admit(stream, add)
        return stream

    async def reserve_remote(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Any,
        *,
        output_token_ids: Sequence[int] = (),
        local_prefill_below: int = 0,
        prefill_cached_tokens: int | None = None,
    ) -> tuple[RemoteReservation | None, RequestStream]:
        """Reserve blocks for a request whose KV a prefill pod will send;
        returns the engine's `RemoteReservation` and the stream its tokens
        will arrive on after `commit_remote`. CapacityError / ValueError
        propagate. The reservation is None when `local_prefill_below` or
        `prefill_cached_tokens` made the engine compute the request itself
        (`LLMEngine.reserve_remote`, engine/local_rule.py):
        its tokens then arrive on the stream from index 0."""
        await self._compile_grammar(sampling_params)
        stream = RequestStream(request_id, asyncio.get_running_loop())

        def reserve(engine: Any) -> RemoteReservation | None:
            self._streams.add(stream)
            try:
                return engine.reserve_remote(
                    request_id,
                    list(prompt_token_ids),
                    sampling_params,
                    output_token_ids=list(output_token_ids),
                    local_prefill_below=local_prefill_below,
                    prefill_cached_tokens=prefill_cached_tokens,
                )
            except BaseException:
                self._streams.discard(stream)
                raise

        reservation = await self._admit(stream, reserve)
        return reservation, stream

    async def _compile_grammar(self, sampling_params: Any) -> None:
        """Compile a request's grammar (structured outputs) on a worker thread,
        into the engine's thread-safe cache, so the engine thread only copies
        the compiled matcher. ValueError when the grammar is invalid."""
        if sampling_params.grammar is not None:
            await asyncio.to_thread(self._engine.grammars.compiler.compile,
                                    sampling_params.grammar)

    async def _admit(self, stream: RequestStream, admit: Callable[[Any], T]) -> T:
        """Run `admit(engine)`, a command that registers `stream` and its
        request. A caller cancelled before the answer arrives (its command
        may still be queued behind a step) leaves nothing held: the command
        skips itself if it has not run yet, and an undo queued behind it
        (commands run in order) aborts the request if it did run. The undo
        finds the request by its stream, so a command that failed on a
        duplicate id never aborts the request that owns the id."""
        cancelled = threading.Event()

        def guarded(engine: Any) -> T:
            if cancelled.is_set():
                raise RequestAborted(stream.request_id, "client")
            return admit(engine)

        def undo(engine: Any) -> None:
            if self._streams.discard(stream) and engine.abort_request(stream.request_id):
                self._streams.aborted(stream.request_id)
                self._metrics.abort("client")

        try:
            return await self.call(guarded)
        except asyncio.CancelledError:
            cancelled.set()
            with contextlib.suppress(EngineDead):  # a stopped loop holds nothing any more
                self.submit(undo, asyncio.get_running_loop())
            raise

    async def abort(self, request_id: str, reason: str) -> bool:
        """Abort a request in any engine state and free its blocks; its
        stream (if still open) ends with `RequestAborted(reason)`. Returns
        whether the request was known to this loop."""

        found = await self.call(
            lambda engine: abort_in(engine, self._streams, request_id, reason))
        if found:
            self._metrics.abort(reason)
        return found

    @property
    def itl_budget(self) -> Any:
        """The engine's `ItlBudget` (engine/itl_budget.py), None when off."""
        return self._engine.scheduler.itl_budget

    def kv_caches(self) -> list[Any]:
        """The engine's per-layer KV cache tensors (never reallocated after
        start), for the decode pod's injector thread."""
        return list(self._engine.kv_caches)

    # ------------------------------------------------------------ loop thread

    def _run(self) -> None:
        try:
            while self._state is LoopState.RUNNING:
                idle = not self._engine.has_unfinished_requests()
                for command in self._commands.drain(block=idle):
                    self._execute(command)
                if self._state is not LoopState.RUNNING:
                    break
                hook = self._step_hook
                if hook is not None and self._engine.has_unfinished_requests():
                    hook.before_step(self._run_commands_for)
                    if self._state is not LoopState.RUNNING:
                        break
                if self._engine.has_unfinished_requests():
                    started = time.monotonic()
                    outputs = self._engine.step()
                    if hook is not None:
                        hook.after_step(time.monotonic() - started)
                    # Stats first: a caller woken by its last output must see
                    # the blocks that output's request released.
                    self._publish_stats()
                    self._streams.dispatch(outputs)
        except BaseException as exc:  # noqa: BLE001 - the pod must learn its engine died
            log.exception("engine loop died")
            self._transition(LoopState.DEAD)
            self._fail_all(EngineDead(f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        self._fail_all(EngineDead("engine loop stopped"))

    def _run_commands_for(self, seconds: float) -> bool:
        """A step hook's `wait`: run the commands queued within `seconds`;
        False once the loop is stopping."""
        for command in self._commands.drain(block=True, timeout=seconds):
            self._execute(command)
        return self._state is LoopState.RUNNING

    def _execute(self, command: Command) -> None:
        try:
            result = command.fn(self._engine)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            command.reject(exc)
        else:
            self._publish_stats()  # the caller may read `stats` right after
            command.resolve(result)

    def _fail_all(self, exc: BaseException) -> None:
        self._streams.end_all(exc)
        # Commands queued before the state changed still owe their callers
        # an answer; `call` queues nothing once the state is not RUNNING.
        for command in self._commands.drain(block=False):
            command.reject(EngineDead(f"engine loop is {self._state.value}"))

    def _publish_stats(self) -> None:
        stats = self._engine.stats()
        self.stats = stats
        self._export.publish(self._engine, stats)


def abort_in(engine: Any, streams: StreamTable, request_id: str, reason: str) -> bool:
    """On the loop that owns `engine` (a real or a simulated one): end the
    request in any state, its open stream with `RequestAborted(reason)`;
    whether this loop knew it."""
    stream = streams.pop(request_id)
    if engine.abort_request(request_id):
        streams.aborted(request_id)
    if stream is not None:
        stream.abort(RequestAborted(request_id, reason))
    return stream is not None

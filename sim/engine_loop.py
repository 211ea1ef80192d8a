"""`SimEngineLoop`: `engine.engine_loop.EngineLoop`'s interface over a
`SimEngine`, on the pod's asyncio loop instead of a thread.

Who uses it: the real servicers (prefill_service/servicer.py,
decode_service/servicer.py and its `KVImport`), pod/load.py's
`load_report` and pod/cache_events.py's hub take it where a real pod gives
them an `EngineLoop`; they call `add_request`, `reserve_remote`, `abort`,
`call`, `submit`, and read `stats`, `block_size`, `max_model_len`,
`device_type`, `tensor_parallel_size`, `itl_budget`, `state`.

Why no thread: hundreds of simulated pods share one process and one event
loop (sim/cluster.py), so each pod is one task. Commands (`call`,
`submit`) run at once, on the event loop, in the order they are made; the
step task runs

    plan = engine.plan_step()  ->  sleep(perf.step_seconds(plan))
      ->  outputs = engine.finish_step(plan)  ->  each output to its stream

and otherwise waits for a command to give the engine work. A command may
therefore run while a step is "in flight" (during its sleep): the
scheduler defers the blocks of a request aborted meanwhile until the step
finishes, as with the real engine's async scheduling. (A real loop runs
commands only between steps; a simulated admission does not wait for the
step in flight, which makes it up to one step earlier.)

Streams are the real `RequestStream` / `StreamTable`
(engine/request_stream.py): a stream is registered before its request
enters the engine, ends with its finished output, `RequestAborted`, or
`EngineDead` when the loop stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from engine.engine_loop import LoopState, abort_in
from engine.metrics import PodMetrics
from engine.outputs import EngineStats, RemoteReservation
from engine.request_stream import EngineDead, RequestStream, StreamTable
from engine.stats_export import StatsExport
from sim.engine import SimEngine
from sim.perf_model import PerfModel

log = logging.getLogger(__name__)

T = TypeVar("T")


class SimEngineLoop:
    """One simulated pod's engine loop; see the module docstring."""

    device_type = "sim"
    tensor_parallel_size = 1
    itl_budget = None  # the simulated scheduler takes no ITL budget

    def __init__(self, engine: SimEngine, perf: PerfModel, metrics: PodMetrics) -> None:
        self._engine = engine
        self._perf = perf
        self._metrics = metrics
        self._streams = StreamTable()
        self._state = LoopState.NEW
        self._work = asyncio.Event()  # set when a command may have given the engine work
        self._task: asyncio.Task[None] | None = None
        self.stats: EngineStats = engine.stats()
        self.block_size: int = engine.config.block_size
        self.max_model_len: int = engine.max_model_len
        self._export = StatsExport(metrics)

    @property
    def state(self) -> LoopState:
        return self._state

    def start(self) -> None:
        """Start the step task (on the pod's running event loop)."""
        if self._state is not LoopState.NEW:
            raise RuntimeError(f"simulated engine loop cannot start from {self._state.value}")
        self._state = LoopState.RUNNING
        self._publish_stats()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    def stop(self, timeout: float = 0.0) -> None:
        """Stop stepping; open streams end with `EngineDead`."""
        if self._state is LoopState.STOPPED:
            return
        self._state = LoopState.STOPPED
        if self._task is not None:
            self._task.cancel()
        self._streams.end_all(EngineDead("engine loop stopped"))

    def wake(self) -> None:
        self._work.set()

    # ------------------------------------------------------------ commands

    def _run_now(self, fn: Callable[[Any], T]) -> T:
        if self._state is not LoopState.RUNNING:
            raise EngineDead(f"engine loop is {self._state.value}")
        try:
            return fn(self._engine)
        finally:
            self._publish_stats()
            self._work.set()

    async def call(self, fn: Callable[[Any], T]) -> T:
        """`fn(engine)` now; EngineDead when the loop is not running."""
        return self._run_now(fn)

    def submit(self, fn: Callable[[Any], T], loop: asyncio.AbstractEventLoop
               ) -> asyncio.Future[T]:
        """`fn(engine)` now; its result or error in a settled future."""
        if self._state is not LoopState.RUNNING:
            raise EngineDead(f"engine loop is {self._state.value}")
        future: asyncio.Future[T] = loop.create_future()
        try:
            future.set_result(self._run_now(fn))
        except Exception as exc:  # noqa: BLE001 - handed to whoever awaits the future
            future.set_exception(exc)
        return future

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                          sampling_params: Any, *, output_token_ids: Sequence[int] = (),
                          prefill_only: bool = False) -> RequestStream:
        stream = RequestStream(request_id, asyncio.get_running_loop())

        def add(engine: SimEngine) -> None:
            self._streams.add(stream)
            try:
                engine.add_request(request_id, prompt_token_ids, sampling_params,
                                   output_token_ids=output_token_ids, prefill_only=prefill_only)
            except BaseException:
                self._streams.discard(stream)
                raise

        self._run_now(add)
        return stream

    async def reserve_remote(self, request_id: str, prompt_token_ids: Sequence[int],
                             sampling_params: Any, *, output_token_ids: Sequence[int] = (),
                             local_prefill_below: int = 0,
                             prefill_cached_tokens: int | None = None,
                             ) -> tuple[RemoteReservation | None, RequestStream]:
        stream = RequestStream(request_id, asyncio.get_running_loop())

        def reserve(engine: SimEngine) -> RemoteReservation | None:
            self._streams.add(stream)
            try:
                return engine.reserve_remote(request_id, prompt_token_ids, sampling_params,
                                             output_token_ids=output_token_ids,
                                             local_prefill_below=local_prefill_below,
                                             prefill_cached_tokens=prefill_cached_tokens)
            except BaseException:
                self._streams.discard(stream)
                raise

        return self._run_now(reserve), stream

    async def abort(self, request_id: str, reason: str) -> bool:
        """`EngineLoop.abort`: the request ends in any state, its stream
        (if open) with `RequestAborted(reason)`."""
        found = self._run_now(
            lambda engine: abort_in(engine, self._streams, request_id, reason))
        if found:
            self._metrics.abort(reason)
        return found

    def kv_caches(self) -> list[Any]:
        return []  # a simulated pod holds no KV tensors

    # ------------------------------------------------------------ step task

    async def _run(self) -> None:
        engine = self._engine
        try:
            while self._state is LoopState.RUNNING:
                if not engine.has_unfinished_requests():
                    self._work.clear()
                    await self._work.wait()
                    continue
                plan = engine.plan_step()
                if plan.scheduled:
                    await asyncio.sleep(self._perf.step_seconds(plan))
                outputs = engine.finish_step(plan)
                self._publish_stats()
                self._streams.dispatch(outputs)
                if not plan.scheduled and not outputs:
                    # work exists but nothing fits (blocks): wait for a change
                    self._work.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._work.wait(), 0.05)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the pod must learn its engine died
            log.exception("simulated engine loop died")
            self._state = LoopState.DEAD
            self._streams.end_all(EngineDead(f"engine step failed: {exc!r}"))

    def _publish_stats(self) -> None:
        # the same gauges from the same scheduler and block manager as a real
        # pod's, token signals included (engine/stats_export.py)
        stats = self._engine.stats()
        self.stats = stats
        self._export.publish(self._engine, stats)

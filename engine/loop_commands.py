"""The engine loop's commands (engine/engine_loop.py): one `fn(engine)` call
each, queued by any thread and run, in the order queued, by the loop thread,
which settles each caller's future on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.request_stream import post

# How long the idle loop sleeps on the command queue before re-checking the
# stop flag; commands wake it at once, so this only bounds shutdown latency.
IDLE_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class Command:
    """One queued `fn(engine)` call and the caller's future (on its event
    loop); only the command settles its future, from the loop thread."""

    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any] = field(compare=False)

    @classmethod
    def new(cls, fn: Callable[[Any], Any]) -> Command:
        """On the caller's event loop."""
        loop = asyncio.get_running_loop()
        return cls(fn, loop, loop.create_future())

    def resolve(self, value: Any) -> None:
        post(self.loop, _set_result, self.future, value)

    def reject(self, exc: BaseException) -> None:
        post(self.loop, _set_exception, self.future, exc)


@dataclass(frozen=True, slots=True)
class Wake:
    """Queued by `EngineLoop.wake` (and `stop`) so an idle loop looks again at once."""


class CommandQueue:
    """Commands for the loop thread, run in the order they were queued.
    Any thread puts; only the loop thread drains."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[Command | Wake] = queue.SimpleQueue()

    def put(self, item: Command | Wake) -> None:
        self._items.put(item)

    def drain(self, block: bool, timeout: float = IDLE_POLL_S) -> Iterator[Command]:
        """Yield commands until the queue is empty; one queued while an earlier
        one runs is yielded in the same drain. `block`: wait up to `timeout`
        for the first item."""
        try:
            item = self._items.get(timeout=timeout) if block else self._items.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, Command):
                yield item
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.cancelled():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.cancelled():
        future.set_exception(exc)

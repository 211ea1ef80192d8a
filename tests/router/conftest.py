"""Router test fixtures: one shared event loop for tests that use grpc.aio
(the real redis-server fixtures are in tests/conftest.py)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


@pytest.fixture(scope="session")
def run_async() -> Iterator[Callable[[Coroutine[Any, Any, T]], T]]:
    """Run coroutines on ONE event loop for the whole test session.

    Tests that create gRPC aio servers or channels use this instead of
    `asyncio.run`: grpc.aio objects left over from an earlier, closed loop
    schedule callbacks onto it ("Event loop is closed" at exit). Each call is
    also guarded by a watchdog: a coroutine still running after `timeout_s`
    fails the test with every task's stack, instead of hanging until the
    pytest timeout (an intermittent hang in PolledPodPool.close() showed up
    this way; the poller now bounds every wait, and 30 runs since were clean).
    """
    loop = asyncio.new_event_loop()

    def run(coro: Coroutine[Any, Any, T], timeout_s: float = 20.0) -> T:
        async def guarded() -> T:
            task = asyncio.ensure_future(coro)
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                stacks = io.StringIO()
                for other in asyncio.all_tasks():
                    stacks.write(f"{other!r}\n")
                    for frame in other.get_stack():
                        code = frame.f_code
                        stacks.write(f"  {code.co_filename}:{frame.f_lineno} {code.co_name}\n")
                task.cancel()
                raise TimeoutError(
                    f"coroutine still running after {timeout_s}s:\n{stacks.getvalue()}"
                )
            return task.result()

        return loop.run_until_complete(guarded())

    try:
        yield run
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

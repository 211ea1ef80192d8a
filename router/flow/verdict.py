"""The prefill pod's verdict on a KV transfer, after the first token.

`router.flow.pd_path.disaggregated` sends the first token to the
client as soon as the prefill pod streams it, before the decode pod has told
the prefill pod whether the transfer landed. These pieces, on the router's
event loop, decide what the verdict still means: `unless_verdict_fails`
lets a failed verdict end the attempt until the decode stream shows its
first token, and `PrefillEnding` leaves the Prefill call when the attempt
ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from router.generation import Delta


async def unless_verdict_fails(deltas: AsyncIterator[Delta],
                                verdict: asyncio.Future[None]) -> AsyncIterator[Delta]:
    """Relay the decode stream after the first token. Until its first delta
    arrives, a failed `verdict` (the prefill pod's) wins: the decode pod takes
    a sender that went away for lost, not failed, and would wait for another
    one until its transfer deadline. From the first delta on the decode pod
    has the KV, and the verdict no longer matters."""
    first = asyncio.ensure_future(_next_or_none(deltas))
    try:
        await asyncio.wait((first, verdict), return_when=asyncio.FIRST_COMPLETED)
        if not first.done() and verdict.exception() is not None:
            raise verdict.exception()
        delta = await first
    finally:
        if not first.done():
            first.cancel()
            await asyncio.wait((first,))  # the decode stream is closed only after it stopped
    if delta is None:
        return
    yield delta
    async for delta in deltas:
        yield delta


async def _next_or_none(deltas: AsyncIterator[Delta]) -> Delta | None:
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        return None


# Verdicts left to finish after their request did (see `PrefillEnding`).
_SETTLING: set[asyncio.Future] = set()


class PrefillEnding:
    """How a disaggregated attempt leaves its Prefill call. When the client
    has its last token (`finished`), the verdict still owed is left to
    arrive in the background (the call's own timeout bounds it), so the
    prefill pod ends the RPC as a completed transfer - counting its KV bytes
    - rather than as a cancel: a short request can end before the verdict
    reaches the prefill pod. Otherwise the call is cancelled (frees the
    prefill pod; tells the decode pod) and the verdict dropped."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self.call = call
        self.verdict: asyncio.Future | None = None
        self.finished = False

    def close(self) -> None:
        verdict = self.verdict
        if self.finished and verdict is not None and not verdict.done():
            _SETTLING.add(verdict)
            verdict.add_done_callback(_settled)
            return
        self.call.cancel()  # a no-op once the verdict came
        if verdict is not None:
            _drop(verdict)


def _settled(task: asyncio.Future) -> None:
    _SETTLING.discard(task)
    _drop(task)


def _drop(task: asyncio.Future) -> None:
    """Cancel `task` if it runs; mark a failure nobody waited for as seen."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()

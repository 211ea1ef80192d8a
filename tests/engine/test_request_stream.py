"""`engine.request_stream`: a `StreamTable` fed from another thread, read with `async for`.

The table is driven from a worker thread here, the way the engine-loop
thread drives it; the readers run on the test's event loop.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.outputs import RequestOutput
from engine.request_stream import EngineDead, RequestAborted, RequestStream, StreamTable

pytestmark = pytest.mark.timeout(30)


def _output(request_id: str, tokens: tuple[int, ...], finish: str | None = None) -> RequestOutput:
    return RequestOutput(request_id, tokens, (), finish, 3, 0, len(tokens))


async def _read(stream: RequestStream) -> list[tuple[int, ...]]:
    return [output.new_token_ids async for output in stream]


def test_outputs_reach_their_own_stream_and_a_finished_one_leaves_the_table():
    async def scenario():
        table = StreamTable()
        loop = asyncio.get_running_loop()
        a, b = RequestStream("a", loop), RequestStream("b", loop)
        table.add(a)
        table.add(b)

        def step() -> None:  # the loop thread
            table.dispatch([_output("a", (1,)), _output("b", (2,))])
            table.dispatch([_output("a", (3,), "length"), _output("gone", (9,))])
            table.dispatch([_output("b", (4,), "stop")])

        await asyncio.to_thread(step)
        got = await asyncio.gather(_read(a), _read(b))
        return got, a.closed, b.closed, table.pop("a"), table.pop("b")

    assert asyncio.run(scenario()) == ([[(1,), (3,)], [(2,), (4,)]], True, True, None, None)


def test_a_second_stream_for_an_id_is_refused_and_discard_undoes_add():
    async def scenario():
        table = StreamTable()
        loop = asyncio.get_running_loop()
        first = RequestStream("r", loop)
        table.add(first)
        with pytest.raises(ValueError, match="request_id 'r' is already in use on this pod"):
            table.add(RequestStream("r", loop))
        table.discard(RequestStream("r", loop))  # not the registered one: kept
        assert table.pop("r") is first
        table.add(first)
        table.discard(first)
        return table.pop("r")

    assert asyncio.run(scenario()) is None


def test_abort_drops_queued_outputs_and_ends_the_stream():
    async def scenario():
        table = StreamTable()
        stream = RequestStream("r", asyncio.get_running_loop())
        table.add(stream)

        def step_then_abort() -> None:
            table.dispatch([_output("r", (1,))])
            popped = table.pop("r")
            assert popped is stream
            popped.abort(RequestAborted("r", "client"))
            popped.abort(RequestAborted("r", "again"))  # closed: ignored
            table.dispatch([_output("r", (2,))])  # no longer in the table

        await asyncio.to_thread(step_then_abort)
        with pytest.raises(RequestAborted) as err:
            await _read(stream)
        return err.value.reason

    assert asyncio.run(scenario()) == "client"


def test_end_all_ends_every_open_stream_after_what_is_queued():
    async def scenario():
        table = StreamTable()
        loop = asyncio.get_running_loop()
        a, b = RequestStream("a", loop), RequestStream("b", loop)
        table.add(a)
        table.add(b)

        def die() -> None:
            table.dispatch([_output("a", (1,))])
            table.end_all(EngineDead("engine loop stopped"))

        await asyncio.to_thread(die)
        seen = []
        with pytest.raises(EngineDead):
            async for output in a:
                seen.append(output.new_token_ids)
        with pytest.raises(EngineDead):
            await _read(b)
        return seen, table.pop("a")

    assert asyncio.run(scenario()) == ([(1,)], None)

"""`engine.engine_loop.EngineLoop` over a real `LLMEngine` on the tiny model,
with synchronous and async scheduling (a step in flight while commands run)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.config import EngineConfig
from engine.engine_loop import EngineDead, EngineLoop, LoopState, RequestAborted
from engine.llm_engine import LLMEngine
from engine.metrics import PodMetrics
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine_config(tiny_model_dir, request) -> EngineConfig:
    return EngineConfig(model_dir=str(tiny_model_dir), num_blocks=64, block_size=16,
                        async_scheduling=request.param)


@pytest.fixture(scope="module")
def reference_tokens(engine_config) -> list[list[int]]:
    """What the engine produces stepped directly, without the loop."""
    engine = LLMEngine(engine_config)
    results = engine.generate([list(range(3, 23)), list(range(40, 77))], GREEDY)
    return [list(r.token_ids) for r in results]


def _run(engine_config, scenario, metrics: PodMetrics | None = None):
    async def main():
        metrics_ = metrics or PodMetrics.create("colocated")
        loop = EngineLoop(LLMEngine(engine_config), metrics_)
        loop.start()
        try:
            return await asyncio.wait_for(scenario(loop), 60)
        finally:
            loop.stop()

    return asyncio.run(main())


async def _collect(stream) -> tuple[list[int], str]:
    tokens, reason = [], ""
    async for output in stream:
        tokens.extend(output.new_token_ids)
        reason = output.finish_reason or reason
    return tokens, reason


@pytest.mark.timeout(120)
def test_concurrent_requests_match_the_engine_stepped_directly(engine_config, reference_tokens):
    async def scenario(loop: EngineLoop):
        a = await loop.add_request("a", list(range(3, 23)), GREEDY)
        b = await loop.add_request("b", list(range(40, 77)), GREEDY)
        return await asyncio.gather(_collect(a), _collect(b)), loop.stats

    (a, b), stats = _run(engine_config, scenario)
    assert a == (reference_tokens[0], "length")
    assert b == (reference_tokens[1], "length")
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks == 64


@pytest.mark.timeout(120)
def test_abort_ends_the_stream_and_frees_blocks(engine_config):
    async def scenario(loop: EngineLoop):
        stream = await loop.add_request("long", [5] * 40, SamplingParams(
            temperature=0.0, max_tokens=400, ignore_eos=True))
        seen = 0
        with pytest.raises(RequestAborted) as err:
            async for output in stream:
                seen += len(output.new_token_ids)
                if seen == 3:
                    assert await loop.abort("long", "client") is True
        assert err.value.reason == "client"
        assert await loop.abort("long", "client") is False  # already gone
        # Async scheduling: the blocks come back once the step in flight
        # completes, which the loop runs right after the command.
        for _ in range(200):
            stats = await loop.call(lambda engine: engine.stats())
            if stats.num_free_blocks == stats.num_total_blocks:
                break
            await asyncio.sleep(0.01)
        await loop.call(lambda engine: None)  # one more pass: stats published
        return seen, loop.stats

    seen, stats = _run(engine_config, scenario)
    assert seen == 3
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.timeout(120)
def test_engine_errors_reach_the_caller_and_the_loop_keeps_serving(engine_config,
                                                                  reference_tokens):
    async def scenario(loop: EngineLoop):
        with pytest.raises(ValueError, match="exceeds max_model_len 4096"):
            await loop.add_request("big", [1] * 4096, GREEDY)
        # The first "dup" runs long enough to still be in the batch when the
        # second arrives (a 6-token request can finish between the two calls).
        first = await loop.add_request("dup", [5] * 20, SamplingParams(
            temperature=0.0, max_tokens=400, ignore_eos=True))
        with pytest.raises(ValueError, match="already in use"):
            await loop.add_request("dup", list(range(3, 23)), GREEDY)
        assert await loop.abort("dup", "client") is True
        with pytest.raises(RequestAborted):
            await _collect(first)
        return await _collect(await loop.add_request("after", list(range(3, 23)), GREEDY))

    assert _run(engine_config, scenario) == (reference_tokens[0], "length")


@pytest.mark.timeout(120)
def test_stop_ends_open_streams_with_engine_dead(engine_config):
    async def scenario(loop: EngineLoop):
        stream = await loop.add_request("s", [7] * 20, SamplingParams(
            temperature=0.0, max_tokens=400, ignore_eos=True))
        iterator = stream.__aiter__()
        await iterator.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, loop.stop)
        with pytest.raises(EngineDead):
            while True:
                await iterator.__anext__()
        with pytest.raises(EngineDead):
            await loop.add_request("late", [7] * 20, GREEDY)
        return loop.state

    assert _run(engine_config, scenario) is LoopState.STOPPED


@pytest.mark.timeout(120)
def test_submit_from_another_thread_settles_on_the_callers_loop(engine_config):
    import threading

    async def scenario(loop: EngineLoop):
        event_loop = asyncio.get_running_loop()
        futures = []

        def other_thread() -> None:
            futures.append(loop.submit(lambda engine: engine.stats().num_total_blocks,
                                       event_loop))
            futures.append(loop.submit(lambda engine: 1 // 0, event_loop))

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        total = await futures[0]
        with pytest.raises(ZeroDivisionError):
            await futures[1]
        loop.stop()
        with pytest.raises(EngineDead, match="engine loop is stopped"):
            loop.submit(lambda engine: None, event_loop)
        return total

    assert _run(engine_config, scenario) == 64


async def _settled(loop: EngineLoop):
    """The engine's stats once nothing is left to step (with async scheduling an
    aborted request's blocks return when the step in flight completes)."""
    for _ in range(500):
        busy, stats = await loop.call(lambda e: (e.has_unfinished_requests(), e.stats()))
        if not busy:
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine never settled: {stats}")


async def _hold_the_loop(loop: EngineLoop) -> tuple[asyncio.Future, threading.Event]:
    """Park the loop thread inside a command until the returned event is set:
    commands queued meanwhile wait behind it, as they wait behind a long step."""
    entered, release = threading.Event(), threading.Event()

    def hold(engine) -> None:
        entered.set()
        release.wait(30)

    held = asyncio.ensure_future(loop.call(hold))
    assert await asyncio.to_thread(entered.wait, 30)
    return held, release


@pytest.mark.timeout(120)
@pytest.mark.parametrize("admission", ["reserve_remote", "add_request"])
def test_an_admission_cancelled_while_queued_holds_nothing(engine_config, admission):
    """A caller cancelled while its reserve_remote / add_request command still
    waits in the queue: once the command runs, nothing it took stays held
    (no sequence slot, no block, no stream), and the id can be used again."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def scenario(loop: EngineLoop):
        baseline = await loop.call(lambda engine: engine.stats())
        held, release = await _hold_the_loop(loop)
        callers = [asyncio.ensure_future(getattr(loop, admission)(f"r{i}", [5] * 30, params))
                   for i in range(8)]
        await asyncio.sleep(0)  # every command is queued behind `hold`
        for caller in callers:
            caller.cancel()
        await asyncio.wait(callers)  # each saw its cancel before its command runs
        release.set()
        await held
        now = await loop.call(lambda engine: engine.stats())  # nothing was admitted
        after = await _settled(loop)
        stream = await loop.add_request("r0", [5] * 30, params)  # the id is free again
        tokens, _ = await _collect(stream)
        return baseline, now, after, len(tokens), loop.stats

    baseline, now, after, num_tokens, final = _run(engine_config, scenario)
    assert (now.num_reserved, now.num_waiting, now.num_running) == (0, 0, 0)
    assert (after.num_reserved, after.num_waiting, after.num_running) == (0, 0, 0)
    assert after.num_free_blocks == baseline.num_free_blocks
    assert num_tokens == 20
    assert final.num_free_blocks == final.num_total_blocks


@pytest.mark.timeout(120)
def test_an_admission_cancelled_after_it_ran_is_undone(engine_config):
    """The reserve command ran (blocks held) but its caller was cancelled before
    reading the answer: the undo queued behind it frees the request."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def scenario(loop: EngineLoop):
        baseline = await loop.call(lambda engine: engine.stats())
        held, release = await _hold_the_loop(loop)
        caller = asyncio.ensure_future(loop.reserve_remote("r", [5] * 30, params))
        await asyncio.sleep(0)  # queued behind `hold`
        entered, release_second = threading.Event(), threading.Event()
        second = asyncio.ensure_future(loop.call(
            lambda engine: (entered.set(), release_second.wait(30))))
        await asyncio.sleep(0)
        release.set()
        # Block this event loop until the reserve ran and the loop thread sits
        # in the second command: the answer is posted but not yet delivered.
        assert entered.wait(30)
        caller.cancel()
        release_second.set()
        await asyncio.gather(held, second)
        with pytest.raises(asyncio.CancelledError):
            await caller
        after = await _settled(loop)
        return baseline, after

    baseline, after = _run(engine_config, scenario)
    assert after.num_reserved == 0
    assert after.num_free_blocks == baseline.num_free_blocks


@pytest.mark.timeout(120)
def test_reserved_requests_show_in_the_gauges(engine_config):
    metrics = PodMetrics.create("decode")

    def gauge(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"role": "decode"})

    async def scenario(loop: EngineLoop):
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        await loop.reserve_remote("a", [5] * 30, params)  # 50 tokens: 4 blocks of 16
        await loop.reserve_remote("b", [5] * 10, params)  # 30 tokens: 2 blocks
        held = gauge("pdserve_requests_reserved"), gauge("pdserve_kv_blocks_reserved")
        await loop.abort("a", "client")
        await loop.abort("b", "client")
        return held, (gauge("pdserve_requests_reserved"), gauge("pdserve_kv_blocks_reserved"))

    held, freed = _run(engine_config, scenario, metrics)
    assert held == (2, 6)
    assert freed == (0, 0)


@pytest.mark.timeout(120)
def test_an_id_reused_right_after_its_abort_gets_its_own_outputs(engine_config,
                                                                 reference_tokens):
    """The aborted request's "abort" output comes out of the next step; a new
    request that took the id in between must not receive it."""
    async def scenario(loop: EngineLoop):
        await loop.add_request("x", [5] * 40, SamplingParams(
            temperature=0.0, max_tokens=400, ignore_eos=True))
        held, release = await _hold_the_loop(loop)
        abort = asyncio.ensure_future(loop.abort("x", "client"))
        await asyncio.sleep(0)
        again = asyncio.ensure_future(loop.add_request("x", list(range(3, 23)), GREEDY))
        await asyncio.sleep(0)
        release.set()
        await held
        assert await abort is True
        return await _collect(await again)

    assert _run(engine_config, scenario) == (reference_tokens[0], "length")

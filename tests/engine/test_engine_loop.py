"""`engine.engine_loop.EngineLoop` over a real `LLMEngine` on the tiny model,
with synchronous and async scheduling (a step in flight while commands run)."""

from __future__ import annotations

import asyncio

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


def _run(engine_config, scenario):
    async def main():
        metrics = PodMetrics.create("colocated")
        loop = EngineLoop(LLMEngine(engine_config), metrics)
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
            stats = await loop.run(lambda engine: engine.stats())
            if stats.num_free_blocks == stats.num_total_blocks:
                break
            await asyncio.sleep(0.01)
        await loop.run(lambda engine: None)  # one more pass: stats published
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
        with pytest.raises(ValueError, match="already in use"):
            first = await loop.add_request("dup", list(range(3, 23)), GREEDY)
            await loop.add_request("dup", list(range(3, 23)), GREEDY)
        return await _collect(first)

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

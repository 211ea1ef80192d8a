"""`CacheEventHub` over a real engine loop (tiny model, prefix cache on, 8
blocks of 16 tokens): a subscriber's snapshot, batches numbered in order as
prompts are computed and evicted, changes coalesced within a batch, a
subscriber that falls too far behind dropped."""

from __future__ import annotations

import asyncio

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.metrics import PodMetrics
from engine.sampling_params import SamplingParams
from pod import cache_events
from pod.cache_events import CacheEventHub
from proto.block_hash import extend_block_hashes

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def prompt(seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 500 + 5 for i in range(40)]  # 2 full blocks of 16


def hashes(tokens: list[int]) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, tokens, 16)
    return out


async def compute(loop: EngineLoop, request_id: str, tokens: list[int]) -> None:
    stream = await loop.add_request(request_id, tokens, GREEDY)
    async for _ in stream:
        pass


def test_snapshot_then_ordered_batches_of_stores_and_evictions(tiny_model_dir, monkeypatch):
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), dtype="float32",
                                    num_blocks=8, block_size=16, enable_prefix_caching=True))
    loop = EngineLoop(engine, PodMetrics.create("prefill"))

    async def scenario() -> None:
        hub = CacheEventHub(role="prefill", generation=42, block_size=16)
        loop.start()
        await hub.attach(loop)
        hub.start("10.0.0.1:5000")
        await compute(loop, "a", prompt(1))
        events = hub.subscribe(loop)
        snapshot = await anext(events)
        assert snapshot.snapshot and set(snapshot.stored) == set(hashes(prompt(1)))
        assert (snapshot.address, snapshot.generation, snapshot.block_size) == (
            "10.0.0.1:5000", 42, 16)
        await compute(loop, "b", prompt(2))
        stored: list[int] = []
        sequence = snapshot.sequence
        while len(stored) < 2:  # a batch holds what changed since the last flush
            batch = await asyncio.wait_for(anext(events), 5)
            assert batch.sequence == sequence + 1 and not batch.snapshot and not batch.evicted
            sequence = batch.sequence
            stored += batch.stored
        assert stored == hashes(prompt(2))
        # 8 blocks: three more 3-block requests evict the oldest cached blocks
        seen_evicted: set[int] = set()
        for seed in (3, 4, 5):
            await compute(loop, f"fill-{seed}", prompt(seed))
        while not set(hashes(prompt(1))) <= seen_evicted:
            batch = await asyncio.wait_for(anext(events), 5)
            assert not set(batch.stored) & set(batch.evicted)  # coalesced
            seen_evicted |= set(batch.evicted)
        await events.aclose()
        assert hub._subscribers == []
        # a subscriber that stops reading is dropped once too far behind: its
        # stream ends after what was queued (the router then resubscribes)
        monkeypatch.setattr(cache_events, "MAX_QUEUED_BATCHES", 1)
        stuck = hub.subscribe(loop)
        await anext(stuck)
        for seed in (6, 7):
            # each computes and evicts blocks: a flush is queued on this loop
            # during the step, before the step's outputs are
            await compute(loop, f"more-{seed}", prompt(seed))
        assert hub._subscribers == []
        assert len([batch async for batch in stuck]) == 1
        await hub.close()

    try:
        asyncio.run(scenario())
    finally:
        loop.stop()

"""The direct path (no Redis): a real prefill pod's `CacheEvents.Subscribe`
stream feeding a router-side `PrefixIndex` through `CacheEventFeed` over a
real `PolledPodPool`: the opening snapshot, stored blocks as they are
computed, and evictions when the pod's cache is full."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.cache_index.feed import CacheEventFeed
from router.cache_index.index import PrefixIndex
from router.registry.poller import PolledPodPool
from router.registry.static import StaticPodSource
from tests.integration.pods import PodProcess, start_pod
from tests.router.test_cache_routing_integration import prefill_directly, prompt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def pod(tiny_model_dir: Path) -> Iterator[PodProcess]:
    # 16 blocks of 16 tokens: a few 100-token prompts fill it and evict the oldest
    pod = start_pod("prefill", tiny_model_dir, num_blocks=16)
    try:
        yield pod
    finally:
        pod.kill()


async def until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        await asyncio.sleep(0.02)


def test_subscribe_stream_snapshot_stores_and_evictions(pod, run_async):
    first = prompt(11)
    prefill_directly(pod, first, "before-subscribing")
    index = PrefixIndex()

    async def scenario() -> None:
        pool = PolledPodPool(StaticPodSource(prefill=(pod.address,)), poll_interval=0.1)
        await pool.start()
        feed = CacheEventFeed(pool, index, interval=0.1)
        await feed.start()
        try:
            assert feed.streams() == [pod.address]
            # the snapshot: what the pod cached before the router subscribed
            await until(lambda: index.cached_prefix(pod.address, first) == 96, "snapshot")
            second = prompt(12)
            assert index.cached_prefix(pod.address, second) == 0
            await asyncio.to_thread(prefill_directly, pod, second, "after")
            await until(lambda: index.cached_prefix(pod.address, second) == 96, "stored")
            # more prompts than the 16 blocks hold: the oldest prefix is evicted
            for seed in range(13, 16):
                await asyncio.to_thread(prefill_directly, pod, prompt(seed), f"fill-{seed}")
            await until(lambda: index.cached_prefix(pod.address, first) < 96, "evicted")
            assert index.num_blocks(pod.address) <= 16
            assert index.missed_batches == 0
        finally:
            await feed.close()
            await pool.close()

    run_async(scenario(), timeout_s=60)

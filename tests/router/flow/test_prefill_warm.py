"""The prefill warm-up's rules (router/flow/prefill_warm.py): it goes only
to a known prefill pod, only while that pod reports no queue, one at a time
per pod; one that waits longer than its limit for an idle pod, or finds too
many waiting behind it, is dropped; every outcome is counted, and a pod that
cannot be reached fails it without raising. (Its effect, a prefill pod whose
cache then holds the turn, is tested on real pods in
tests/integration/test_decode_prefix_reuse.py.)"""

from __future__ import annotations

import asyncio
import contextlib

from benchmarks.peer_servers import free_port
from router.flow import prefill_warm
from router.flow.prefill_warm import PrefillWarmer
from router.metrics import RouterMetrics
from router.pod_channels import PodChannels
from tests.router.test_local_prefill import _load, _Pool

UNREACHABLE = f"127.0.0.1:{free_port()}"  # nothing listens there


def _count(metrics: RouterMetrics, outcome: str) -> float:
    return metrics.prefill_warms.labels(outcome=outcome)._value.get()


async def _until(check, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


@contextlib.asynccontextmanager
async def _warmer(wait_s: float):
    """(a busy prefill pod at UNREACHABLE's pool, its warmer, the metrics)."""
    pool = _Pool(_load(UNREACHABLE, "prefill", num_waiting=2))
    metrics, channels = RouterMetrics(), PodChannels()
    warmer = PrefillWarmer(pool, channels, metrics, timeout_s=10, wait_s=wait_s)
    try:
        yield pool, warmer, metrics
    finally:
        await warmer.close()
        await channels.close()


def test_warm_ups_wait_for_an_idle_known_prefill_pod():
    async def run() -> None:
        async with _warmer(wait_s=0.3) as (pool, warmer, metrics):
            assert not warmer.warm("", "r0", [1, 2, 3])  # no prefill pod chosen
            assert not warmer.warm("127.0.0.1:2", "r1", [1, 2, 3])  # not a known pod
            assert _count(metrics, "skipped") == 2
            # the pod stays busy past the wait: dropped
            assert warmer.warm(UNREACHABLE, "r2", [1, 2, 3])
            await _until(lambda: _count(metrics, "skipped") == 3)
            assert _count(metrics, "failed") == 0
            # busy, then idle within the wait: sent (and it fails: nothing listens)
            warmer.warm(UNREACHABLE, "r3", [1, 2, 3])
            await asyncio.sleep(0.1)
            pool.report(UNREACHABLE, num_waiting=0)
            await _until(lambda: _count(metrics, "failed") == 1)
            assert _count(metrics, "skipped") == 3 and _count(metrics, "done") == 0

    asyncio.run(run())


def test_too_many_waiting_drops_the_oldest():
    async def run() -> None:
        async with _warmer(wait_s=5.0) as (pool, warmer, metrics):
            for i in range(prefill_warm.MAX_PENDING + 2):  # the first one is already waiting
                assert warmer.warm(UNREACHABLE, f"r{i}", [1, 2, 3])
                await asyncio.sleep(0)
            assert _count(metrics, "skipped") == 1
            pool.report(UNREACHABLE, num_waiting=0)
            await _until(lambda: _count(metrics, "failed") == prefill_warm.MAX_PENDING + 1)

    asyncio.run(run())

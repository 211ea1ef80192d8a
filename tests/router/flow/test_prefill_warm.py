"""The prefill warm-up's rules (router/flow/prefill_warm.py): it goes only
to a known prefill pod with nothing waiting and none of this router's
warm-ups in flight there; every outcome is counted, and a pod that cannot
be reached fails it without raising. (Its effect, a prefill pod whose cache
then holds the turn, is tested on real pods in
tests/integration/test_decode_prefix_reuse.py.)"""

from __future__ import annotations

import asyncio

from benchmarks.peer_servers import free_port
from router.flow.prefill_warm import PrefillWarmer
from router.metrics import RouterMetrics
from router.pod_channels import PodChannels
from tests.router.test_local_prefill import _load, _Pool

UNREACHABLE = f"127.0.0.1:{free_port()}"  # nothing listens there


def _count(metrics: RouterMetrics, outcome: str) -> float:
    return metrics.prefill_warms.labels(outcome=outcome)._value.get()


def test_warm_ups_go_to_idle_known_prefill_pods_one_at_a_time():
    async def run() -> None:
        pool = _Pool(_load(UNREACHABLE, "prefill"), _load("127.0.0.1:1", "prefill",
                                                          num_waiting=1))
        metrics, channels = RouterMetrics(), PodChannels()
        warmer = PrefillWarmer(pool, channels, metrics, timeout_s=10)
        try:
            assert not warmer.warm("", "r0", [1, 2, 3])  # no prefill pod chosen
            assert not warmer.warm("127.0.0.1:2", "r1", [1, 2, 3])  # not a known pod
            assert not warmer.warm("127.0.0.1:1", "r2", [1, 2, 3])  # a queue there
            assert _count(metrics, "skipped") == 3
            assert warmer.warm(UNREACHABLE, "r3", [1, 2, 3])
            assert not warmer.warm(UNREACHABLE, "r4", [1, 2, 3])  # one in flight there
            assert _count(metrics, "skipped") == 4
            for _ in range(200):
                if _count(metrics, "failed"):
                    break
                await asyncio.sleep(0.05)
            assert _count(metrics, "failed") == 1 and _count(metrics, "done") == 0
            assert warmer.warm(UNREACHABLE, "r5", [1, 2, 3])  # none in flight any more
        finally:
            await warmer.close()
            await channels.close()

    asyncio.run(run())

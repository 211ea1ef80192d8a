"""A simulated pod publishes the token gauges a real pod does
(engine/token_gauges.py through `PodMetrics.publish_tokens`), so the
autoscaling signals (docs/observability.md) can be read off a simulated
cluster: prompt tokens waiting, running context, KV cache use, queue wait.

The step is made 40 s long (a profile with 1 s per prompt token), so the
first request stays "in flight" while the test looks: the values are exact,
not timed."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from engine.metrics import PodMetrics
from engine.sampling_params import SamplingParams
from sim.engine import SimEngine, SimEngineConfig
from sim.engine_loop import SimEngineLoop
from sim.perf_model import PerfModel

SLOW = PerfModel(name="slow", step_overhead_s=0.0, prefill_s_per_token=1.0,
                 decode_s_per_seq=0.0, decode_s_per_context_token=0.0,
                 link_bytes_per_s=1e9, link_latency_s=0.0, kv_cache_bytes=1 << 20)


def test_a_simulated_pod_publishes_the_token_gauges() -> None:
    registry = CollectorRegistry()
    metrics = PodMetrics.create("colocated", registry)
    engine = SimEngine(SimEngineConfig(vocab_size=1000, max_model_len=512, num_blocks=8,
                                       block_size=16, enable_prefix_caching=True))
    loop = SimEngineLoop(engine, SLOW, metrics)

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"role": "colocated"})

    async def scenario() -> None:
        loop.start()
        params = SamplingParams(max_tokens=4)
        await loop.add_request("r1", list(range(1, 41)), params)
        await asyncio.sleep(0.3)  # r1's step (40 s) begins; past the 0.1 s recount interval
        await loop.add_request("r2", list(range(100, 130)), params)
        loop.stop()

    asyncio.run(scenario())
    # r1's prompt is all planned (the scheduler counts a planned chunk as
    # computed, as with the real engine's async scheduling); r2 waits with
    # 30 tokens and no cached prefix
    assert value("pdserve_prompt_tokens_waiting") == 30.0
    assert value("pdserve_running_context_tokens") == 40.0
    # r1 holds ceil(40 / 16) = 3 of the 8 blocks; r2 none yet
    assert value("pdserve_kv_cache_usage_ratio") == 3 / 8
    # r1 left the queue when its step was planned: one wait, counted at the next command
    assert value("pdserve_queue_wait_seconds_count") == 1.0
    assert value("pdserve_queue_wait_p50_seconds") > 0.0

"""`router.metrics.LoopHistogram`: the router's inter-token latency, counted
in plain lists and put into its prometheus_client histogram once per loop
iteration, renders exactly as a histogram observed one value at a time."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from router.metrics import _LATENCY_BUCKETS, LoopHistogram, RouterMetrics


def _histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram("pdserve_inter_token_latency_seconds", "ITL", ["role"],
                     buckets=_LATENCY_BUCKETS, registry=registry).labels(role="router")


def _observations(rng: random.Random) -> list[tuple[float, int]]:
    """Gaps on and around every bucket bound, and random ones, with counts."""
    gaps = [b * f for b in _LATENCY_BUCKETS for f in (0.5, 1.0, 1.0000001)]
    gaps += [rng.expovariate(1 / 0.05) for _ in range(300)] + [0.0, 100.0]
    return [(gap, rng.choice((1, 1, 1, 2, 7))) for gap in gaps]


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _assert_same(batched: CollectorRegistry, plain: CollectorRegistry) -> None:
    got, want = _samples(batched), _samples(plain)
    assert got.keys() == want.keys()
    for name, value in want.items():
        # the sum is added per batch, not per observation: rounding may differ
        assert abs(got[name] - value) <= 1e-9 * max(1.0, abs(value)), name


def test_batched_counts_render_as_one_observation_at_a_time() -> None:
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    observations = _observations(rng)
    rng.shuffle(observations)
    batched_registry, plain_registry = CollectorRegistry(), CollectorRegistry()
    histogram, plain = LoopHistogram(_histogram(batched_registry)), _histogram(plain_registry)
    assert histogram.batched, "prometheus_client's fields are where LoopHistogram expects"

    async def main() -> None:
        for i, (gap, count) in enumerate(observations):
            histogram.observe(gap, count)
            for _ in range(count):
                plain.observe(gap)
            if i % 37 == 0:
                await asyncio.sleep(0)  # a loop iteration: the pending counts go in

        await asyncio.sleep(0)

    asyncio.run(main())
    _assert_same(batched_registry, plain_registry)


def test_counts_pending_in_this_iteration_are_in_the_render() -> None:
    """`RouterMetrics.render` flushes first: a scrape sees every token."""
    metrics = RouterMetrics()

    async def main() -> bytes:
        for _ in range(5):
            metrics.for_path("split").itl.observe(0.03)
        return metrics.render()  # before the loop ran the flush

    text = asyncio.run(main()).decode()
    assert 'pdserve_inter_token_latency_seconds_count{path="split",role="router"} 5.0' in text
    assert ('pdserve_inter_token_latency_seconds_bucket{le="0.05",path="split",role="router"} '
            '5.0') in text


def test_without_a_loop_each_observation_goes_in_at_once() -> None:
    registry = CollectorRegistry()
    histogram = LoopHistogram(_histogram(registry))
    histogram.observe(0.2, 3)
    assert registry.get_sample_value("pdserve_inter_token_latency_seconds_count",
                                     {"role": "router"}) == 3


def test_a_histogram_without_the_fields_is_observed_one_by_one() -> None:
    """Another prometheus_client whose histogram keeps its counts elsewhere
    still gets every observation, through its public `observe`."""

    class Other:
        def __init__(self) -> None:
            self.values: list[float] = []

        def observe(self, value: float) -> None:
            self.values.append(value)

    other = Other()
    histogram = LoopHistogram(other)  # type: ignore[arg-type]
    assert not histogram.batched
    histogram.observe(0.5, 2)
    histogram.flush()
    assert other.values == [0.5, 0.5]


def test_multiprocess_mode_counts_in_the_shared_files(tmp_path) -> None:
    """With `--workers N` every worker's histogram lives in prometheus_client's
    multiprocess files (its mode is chosen at import, so a fresh process)."""
    script = (
        "from router.metrics import RouterMetrics\n"
        f"m = RouterMetrics(multiprocess_dir={str(tmp_path)!r})\n"
        "itl = m.for_path('colocated').itl\n"
        "assert itl.batched\n"
        "itl.observe(0.03, 4)\n"
        "itl.observe(0.2)\n"
        "print(m.render().decode())\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    text = subprocess.run([sys.executable, "-c", script], env=env, check=True,
                          capture_output=True, text=True, timeout=60).stdout
    labels = 'path="colocated",role="router"'
    assert f'pdserve_inter_token_latency_seconds_count{{{labels}}} 5.0' in text
    assert f'pdserve_inter_token_latency_seconds_bucket{{le="0.05",{labels}}} 4.0' in text
    assert f'pdserve_inter_token_latency_seconds_sum{{{labels}}} 0.32' in text

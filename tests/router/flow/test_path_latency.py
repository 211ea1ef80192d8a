"""The router's TTFT / ITL / E2E histograms by `path` (router/metrics.py
`PATHS`): a request is counted under the path of the attempt that sent its
first token, every path's series exists from the start, and the label takes
no value outside the enum. In-process fake pods (tests/router/inprocess_pods.py)."""

from __future__ import annotations

import pytest

from router.flow.tracing import _PATHS
from router.metrics import PATHS, RouterMetrics
from tests.router.flow.test_request_flow import PROMPT, Cluster, _collect, run
from tests.router.inprocess_pods import expected_text

pytestmark = pytest.mark.timeout(60)
LATENCIES = ("pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
             "pdserve_e2e_request_latency_seconds")


def _counts(cluster: Cluster) -> dict[str, tuple[float, float, float]]:
    """path -> (TTFT, ITL, E2E) observation counts, for every path with any."""
    counts = {path: tuple(cluster.sample(f"{name}_count", role="router", path=path)
                          for name in LATENCIES) for path in PATHS}
    return {path: c for path, c in counts.items() if any(c)}


def test_a_disaggregated_and_a_colocated_request_count_under_their_paths():
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        await cluster.add("decode")
        async with cluster:
            deltas = await _collect(cluster.flow(max_tokens=6))
        assert _text_of(deltas) == expected_text(PROMPT, 6)
        assert _counts(cluster) == {"disaggregated": (1, 5, 1)}

        colocated = Cluster()
        await colocated.add("colocated")
        async with colocated:
            await _collect(colocated.flow(max_tokens=4))
        assert _counts(colocated) == {"colocated": (1, 3, 1)}
    run(main())


def test_a_migrated_request_counts_once_under_its_first_tokens_path():
    """The decode pod breaks after 2 tokens; the request moves to a new pair
    (a second attempt) and still counts one TTFT and one E2E, on one path."""
    async def main():
        cluster = Cluster()
        await cluster.add("prefill")
        first = await cluster.add("decode", break_after=2)
        second = await cluster.add("decode")
        async with cluster:
            second.active.update({"x", "y"})  # `first` looks idler: chosen first
            await cluster.pool.poll_once()
            deltas = await _collect(cluster.flow(max_tokens=8))
        assert _text_of(deltas) == expected_text(PROMPT, 8)
        assert cluster.sample("pdserve_migrations_total") == 1 and len(first.requests) == 1
        assert _counts(cluster) == {"disaggregated": (1, 7, 1)}
    run(main())


def test_every_path_is_exported_from_the_start_and_no_other():
    metrics = RouterMetrics()
    text = metrics.render().decode()
    for name in LATENCIES:
        exported = {line.split('path="', 1)[1].split('"', 1)[0]
                    for line in text.splitlines() if line.startswith(f"{name}_count{{")}
        assert exported == set(PATHS)
    # the trace attribute's values are the label's (one enum, router/flow/tracing.py)
    assert set(_PATHS.values()) | {"split"} == set(PATHS)
    assert metrics.for_path(None) is metrics.for_path("disaggregated")
    with pytest.raises(ValueError, match="'direct' is not one of"):
        metrics.for_path("direct")


def _text_of(deltas) -> str:
    return "".join(d.text for d in deltas)

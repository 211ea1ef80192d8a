"""One Prometheus page for every pod of a `pdserve sim` process.

A real pod serves its own /metrics; a thousand simulated pods cannot each
hold an HTTP port, so `pdserve sim --metrics-port` serves one page where
each pod's samples carry a `pod` label (its gRPC address) beside the
labels a real pod's have. An autoscaler's queries (docs/observability.md,
"Autoscaling on token signals") then read a simulated cluster as they read
pods scraped one by one: `sum by (pod)`, or `avg` over a role.

Who uses it: `SimCluster.start` (sim/cluster.py) when its config names a
metrics port. `ClusterMetrics.collect` runs on the HTTP server's thread
while the pods' event loop updates their metrics; prometheus_client's
values are safe to read from any thread, and the pod list is only appended
to before the page is served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

POD_LABEL = "pod"

PodRegistries = Callable[[], Iterable[tuple[str, CollectorRegistry]]]


class ClusterMetrics(Collector):
    """Every pod's metric families merged by name, each sample labelled
    with its pod (one HELP/TYPE per family, as the text format requires)."""

    def __init__(self, pods: PodRegistries) -> None:
        self._pods = pods

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for address, registry in self._pods():
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(
                    s._replace(labels={**s.labels, POD_LABEL: address}) for s in family.samples)
        return iter(families.values())


def serve_cluster_metrics(pods: PodRegistries, host: str, port: int):  # -> (server, port)
    """Serve the merged page over HTTP in a daemon thread; `port=0` picks a
    free one. Returns the server (for `shutdown`) and its port."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterMetrics(pods))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, int(server.server_address[1])

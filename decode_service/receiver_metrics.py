"""Receiver counters on the decode pod's /metrics, read from `KVReceiver.stats()`.

`PodMetrics` (engine/metrics.py) holds what every pod exports; these only
exist on a decode pod with a KV receiver, so they are a scrape-time collector
on the same registry instead of metric objects someone has to keep in sync:

* `pdserve_kv_senders_lost_total{role}`: sending attempts that went away before
  END (stream broke, ABORT, or superseded); each transfer then waited for a
  retry's BEGIN against the same reservation.
* `pdserve_kv_received_bytes_total{role}`: verified KV bytes that landed, counted
  as they land (a retried transfer counts both attempts' bytes).
* `pdserve_kv_port_refusals_total{role, reason}`: frames and connections the KV
  port refused (bad magic, bad ticket, bad checksum, oversized length, a stalled
  frame, over the connection limit, ...; the reasons are in kv_transfer/refusals.py).
* `pdserve_kv_port_connections{role}` (gauge): sender connections open now (TCP).

Called by prometheus_client on the metrics server's thread at every scrape;
`stats()` is thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from kv_transfer.base import KVReceiver


class ReceiverCollector(Collector):
    def __init__(self, receiver: KVReceiver, role: str) -> None:
        if not role:
            raise ValueError("role must be a non-empty label value")
        self._receiver = receiver
        self._role = role

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._receiver.stats()
        for name, doc, value in (
            ("pdserve_kv_senders_lost", "KV sending attempts that went away before END.",
             stats.senders_lost),
            ("pdserve_kv_received_bytes", "Verified KV bytes that landed on this pod.",
             stats.bytes_received),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc, labels=["role"])
            family.add_metric([self._role], value)
            yield family
        refusals = CounterMetricFamily(
            "pdserve_kv_port_refusals", "Frames and connections the KV port refused.",
            labels=["role", "reason"])
        for reason, count in sorted(stats.refusals.items()):
            refusals.add_metric([self._role, reason], count)
        yield refusals
        connections = GaugeMetricFamily(
            "pdserve_kv_port_connections", "Sender connections open on the KV port.",
            labels=["role"])
        connections.add_metric([self._role], stats.open_connections)
        yield connections
        pending = GaugeMetricFamily(
            "pdserve_kv_port_pending_connections",
            "Connections on the KV port that have not yet sent a BEGIN with a valid "
            "ticket (no thread, no slot; closed after --kv-auth-timeout).", labels=["role"])
        pending.add_metric([self._role], stats.pending_connections)
        yield pending

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self)

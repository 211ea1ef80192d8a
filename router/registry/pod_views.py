"""`PodViews`: the pool's healthy pods per role, kept current by change.

A routing decision reads the pool several times per request (the policy's
candidates, the local-prefill rule, admission). At 1,000 pods, rebuilding
those lists on every read was most of a decision's time (docs/routing.md,
"Choosing among many pods"). The views are patched instead:

* `changed(address)` — the pool calls it when a pod's report, state or this
  router's in-flight count there changed; the next read patches that pod's
  entries (its `PodLoad` rebuilt once, moved in the load order);
* `reset()` — the pod set changed (the registry listing, close): the next
  read rebuilds everything, as does a pod becoming or ceasing to be healthy
  (rare next to load changes).

Two orders per role, of HEALTHY pods only:

* by address (`pods`): the `PodPool.pods` contract;
* by load (`by_load`, `load_key`): the order `RoutingPolicy.choose_decode`
  ranks decode pods in when no prefix decides, so a choice walks from the
  front and stops at the first pod with room instead of scanning every pod.

Used only by `PolledPodPool` (router/registry/poller.py), on the router's
event loop.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from router.registry.pod_state import PodRecord, PodState
from router.routing.base import PodLoad, load_key

LoadKey = tuple[int, int, str]


class PodViews:
    """Per-role lists of HEALTHY pods' `PodLoad`s, patched by change (module docstring)."""

    def __init__(self, records: dict[str, PodRecord],
                 in_flight: Callable[[str], tuple[int, int]]) -> None:
        self._records = records  # the pool's own dict, read when refreshing
        self._in_flight = in_flight  # `PodPool.in_flight`: this router's requests, tokens
        self._stale = True
        self._dirty: set[str] = set()
        self._by_address: dict[str, list[PodLoad]] = {}
        self._position: dict[str, int] = {}  # address -> index in its role's by-address list
        self._order: dict[str, list[LoadKey]] = {}
        self._key: dict[str, LoadKey] = {}  # address -> its key in its role's load order
        self._loads: dict[str, PodLoad] = {}
        self._addresses: dict[str, frozenset[str]] = {}  # role -> its healthy pods

    def changed(self, address: str) -> None:
        if not self._stale:
            self._dirty.add(address)

    def reset(self) -> None:
        self._stale = True
        self._dirty.clear()

    def pods(self, role: str) -> list[PodLoad]:
        self._refresh()
        return list(self._by_address.get(role, ()))

    def pod(self, role: str, address: str) -> PodLoad | None:
        self._refresh()
        load = self._loads.get(address)
        return load if load is not None and load.role == role else None

    def addresses(self, role: str) -> frozenset[str]:
        self._refresh()
        return self._addresses.get(role, frozenset())

    def by_load(self, role: str) -> Iterator[PodLoad]:
        self._refresh()
        loads = self._loads
        return (loads[key[2]] for key in list(self._order.get(role, ())))

    def _refresh(self) -> None:
        if not self._stale and self._dirty:
            dirty, self._dirty = self._dirty, set()
            for address in dirty:
                if not self._patch(address):
                    self._stale = True
                    break
        if self._stale:
            self._rebuild()

    def _patch(self, address: str) -> bool:
        """Patch one pod's entries; False when its membership changed (rebuild)."""
        record = self._records.get(address)
        healthy = record is not None and record.state is PodState.HEALTHY
        position = self._position.get(address)
        if healthy != (position is not None):
            return False
        if record is None or position is None:
            return True  # neither listed before nor now
        load = self._load_of(record)
        if load is self._loads[address]:
            return True
        self._loads[address] = load
        self._by_address[load.role][position] = load
        key, old = load_key(load), self._key[address]
        if key != old:
            order = self._order[load.role]
            del order[bisect.bisect_left(order, old)]
            bisect.insort(order, key)
            self._key[address] = key
        return True

    def _rebuild(self) -> None:
        self._by_address, self._order, self._loads = {}, {}, {}
        self._position, self._key = {}, {}
        for address in sorted(self._records):
            record = self._records[address]
            if record.state is not PodState.HEALTHY:
                continue
            load = self._load_of(record)
            listed = self._by_address.setdefault(load.role, [])
            self._position[address] = len(listed)
            listed.append(load)
            self._loads[address] = load
            self._key[address] = load_key(load)
        for address, key in self._key.items():
            self._order.setdefault(self._loads[address].role, []).append(key)
        for order in self._order.values():
            order.sort()
        self._addresses = {role: frozenset(p.address for p in listed)
                           for role, listed in self._by_address.items()}
        self._stale = False
        self._dirty.clear()

    def _load_of(self, pod: PodRecord) -> PodLoad:
        """`pod`'s PodLoad, rebuilt only when its report or in-flight count changed."""
        report = pod.report
        assert report is not None, "a HEALTHY pod always has a report"
        requests, tokens = self._in_flight(pod.entry.address)
        key = (report, requests, tokens)
        if pod.load is not None and pod.load_key == key:  # the report: `is` first
            return pod.load
        pod.load_key, pod.load = key, PodLoad(
            address=pod.entry.address,
            role=pod.entry.role,
            healthy=True,
            generation=report.generation,
            num_waiting=report.num_waiting,
            num_waiting_tokens=report.num_waiting_tokens,
            num_running=report.num_running,
            num_free_blocks=report.num_free_blocks,
            num_total_blocks=report.num_total_blocks,
            block_size=report.block_size,
            prefix_hit_rate=min(1.0, max(0.0, report.prefix_hit_rate)),
            in_flight=requests,
            in_flight_tokens=tokens,
            cache_events_channel=report.cache_events_channel,
            device=report.device,
            tensor_parallel_size=max(1, report.tensor_parallel_size),  # 0: an older pod
        )
        return pod.load

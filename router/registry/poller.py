"""PolledPodPool: the router's live view of its pods (health + load).

Life of a pod in the pool (checked transitions, `PodState`):

    NEW --poll ok--> HEALTHY --poll failed / mark_unhealthy / draining--> UNHEALTHY
     |                  ^                                                    |
     +--poll failed-----|-------------------------> UNHEALTHY --poll ok------+
    NEW / UNHEALTHY --gone from the registry--> (removed, channel closed)
    HEALTHY --gone from the registry--> kept, `absent_since` set; removed (channel
            closed) once it is not HEALTHY or `absent_grace` seconds have passed;
            listed again: `absent_since` cleared

A pod missing from the registry is not dropped while it still answers its
polls: a registry that comes back empty (Redis restarted without persistence,
FLUSHALL, failover to an empty replica) would otherwise take every pod out of
rotation at once until their heartbeats re-register them (issue 11, defect 4).
It stays routable until a poll fails (a crashed pod; a drained pod reports
`draining` and is UNHEALTHY at once) or `absent_grace` seconds pass without it
re-registering (a pod cut off from Redis but not from the router). A pod listed
under another role is replaced at once.

Every `poll_interval` seconds, on the router's event loop, the pool asks its
`PodSource` which pods exist, then polls all of them concurrently: the
standard gRPC health check (service "") and GetLoad, each bounded by
`poll_timeout`. Only HEALTHY pods are returned by `pods()`, so a pod that dies
stops getting traffic within one interval, and a new one gets traffic after its
first successful poll. A pod that answers too slowly stays routable through
`SLOW_POLLS_TOLERATED` slow polls in a row (alive but starved for a moment),
then is UNHEALTHY too. A pod whose LoadReport says `draining` or names another
role is UNHEALTHY: it takes no new work.

Load reports are pushed once a pod answers a poll: one `WatchLoad` stream per
HEALTHY pod (router/registry/load_watch.py), each report applied as a poll's.
A pod with a live stream is polled only every `health_interval`; the stream's
end (UNHEALTHY at once, as a failed poll) or silence past its heartbeat
deadline (a slow poll) puts it back on polling, and a good poll opens a new
stream. An older pod without the RPC (UNIMPLEMENTED) is polled as before;
`watch=False` polls every pod (before issue 43; docs/simulator.md).

The pool owns one gRPC channel per pod for polling and its stream (the server
keeps its own channels for requests). `start()`/`close()` are awaited by the
router server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.limits import GRPC_RECONNECT_OPTIONS
from proto.tls import PodSecurity, pod_channel
from router.registry.base import PodEntry, PodSource
from router.registry.load_watch import LoadWatch
from router.registry.pod_state import (
    MAX_POLLS_PER_ROUND,
    SLOW_POLLS_TOLERATED,
    PodRecord,
    PodState,
    longest_unpolled,
)
from router.registry.pod_views import PodViews
from router.routing.base import PodLoad, PodPool, check_role

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 5.0
# No BDP probing on the pool's channels: a load stream's small reports made the
# channel ping after each one, and the pod's server answered the pings with
# GOAWAY "Too many pings", ending every stream at once (seen at 1,000 pods).
_POOL_CHANNEL_OPTIONS = (*GRPC_RECONNECT_OPTIONS, ("grpc.http2.bdp_probe", 0))
# The pool's own traffic is bounded in total, not per pod: past these rates
# the heartbeat and the health poll of a pod with a live stream come less
# often (1,000 pods: a heartbeat every 4 s, a health poll every 20 s), so a
# router's idle work stops growing with the pods it serves. A crashed pod
# still leaves at once (its stream breaks); only a hung one takes longer.
MAX_HEARTBEATS_PER_S = 250.0
MAX_HEALTH_POLLS_PER_S = 50.0


class PolledPodPool(PodPool):
    """A `PodPool` fed by a `PodSource` and kept fresh by polling. See module docstring."""

    def __init__(
        self,
        source: PodSource,
        *,
        poll_interval: float = 0.5,
        poll_timeout: float | None = None,
        security: PodSecurity | None = None,
        absent_grace: float = 10.0,
        watch: bool = True,
        heartbeat_interval: float = 2.0,
        health_interval: float = 10.0,
        list_interval: float | None = None,
        on_report: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        if not 0.01 <= poll_interval <= 60:
            raise ValueError(f"load poll interval must be in [0.01, 60] s; got {poll_interval}")
        if not 0 <= absent_grace <= 3600:
            raise ValueError(f"registry absent grace must be in [0, 3600] s; got {absent_grace}")
        self.absent_grace = absent_grace
        if not 0.1 <= heartbeat_interval <= 60 or not 0.1 <= health_interval <= 3600:
            raise ValueError(f"load heartbeat interval must be in [0.1, 60] s and health "
                             f"interval in [0.1, 3600] s; got {heartbeat_interval}, "
                             f"{health_interval}")
        self.watch = watch
        self.heartbeat_interval = heartbeat_interval
        self.health_interval = health_interval
        self._heartbeat_s, self._health_s = heartbeat_interval, health_interval  # per round
        # counts each report received: "stream" or "poll" (a metric)
        self._on_report = on_report or (lambda source: None)
        self.poll_interval = poll_interval
        # The registry is listed every round unless `list_interval` is longer:
        # the router lists every 2 s with streams (router/server.py), as a
        # listing of 1,000 pods is ~12 ms of parsing, and a pod that leaves
        # says so on its stream first (a `draining` report, or its end).
        self.list_interval = list_interval if list_interval is not None else poll_interval
        if not poll_interval <= self.list_interval <= 60:
            raise ValueError(f"registry list interval must be in [poll interval "
                             f"{poll_interval}, 60] s; got {self.list_interval}")
        self._listed_at = -float("inf")  # monotonic time of the last registry listing
        self.poll_timeout = poll_timeout if poll_timeout is not None else max(0.5, poll_interval)
        if self.poll_timeout <= 0:
            raise ValueError(f"poll_timeout must be > 0; got {self.poll_timeout}")
        self._source = source
        self._security = security or PodSecurity()  # TLS + token of the poll channels
        self._pods: dict[str, PodRecord] = {}
        self._views = PodViews(self._pods, self.in_flight)  # what `pods()` returns, kept current
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()  # channels of pods that left

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("PolledPodPool.start() called twice")
        await self.poll_once()
        self._task = asyncio.create_task(self._run(), name="pod-poller")

    async def close(self) -> None:
        # Bounded waits: shutdown must finish even if a gRPC call ignores cancellation.
        if self._task is not None:
            self._task.cancel()
            done, _ = await asyncio.wait({self._task}, timeout=_CLOSE_TIMEOUT_S)
            if not done:
                log.warning("pod poller did not stop within %.0f s; abandoning it",
                            _CLOSE_TIMEOUT_S)
        for pod in self._pods.values():
            self._stop_watch(pod)
            self._close_channel(pod.channel)
        self._pods.clear()
        self._views.reset()
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=_CLOSE_TIMEOUT_S)
        await asyncio.wait_for(self._source.close(), _CLOSE_TIMEOUT_S)

    def _close_channel(self, channel: grpc.aio.Channel) -> None:
        """Close in the background, so a slow close never delays a poll."""
        task = asyncio.create_task(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def pods(self, role: str) -> list[PodLoad]:
        return self._views.pods(check_role(role))

    def pod(self, role: str, address: str) -> PodLoad | None:
        return self._views.pod(check_role(role), address)

    def addresses(self, role: str) -> AbstractSet[str]:
        return self._views.addresses(check_role(role))

    def by_load(self, role: str) -> Iterator[PodLoad]:
        return self._views.by_load(check_role(role))

    def _load_changed(self, address: str) -> None:
        self._views.changed(address)

    def _move(self, pod: PodRecord, state: PodState, reason: str) -> None:
        pod.move(state, reason)
        self._views.changed(pod.entry.address)

    def known(self, role: str) -> list[str]:
        check_role(role)
        return sorted(a for a, pod in self._pods.items() if pod.entry.role == role)

    def state(self, address: str) -> tuple[PodState, str] | None:
        """(state, reason) of a known pod, for /ready details and tests; None if unknown."""
        pod = self._pods.get(address)
        return None if pod is None else (pod.state, pod.reason)

    def mark_unhealthy(self, address: str, reason: str) -> None:
        pod = self._pods.get(address)
        if pod is not None:
            self._move(pod, PodState.UNHEALTHY, reason)

    async def poll_once(self, *, list_registry: bool = True) -> None:
        """Refresh the pod set from the source (unless `list_registry` is
        False: the background rounds between listings) and poll every pod due.

        Every await here is bounded (`asyncio.wait_for`), so neither a stuck
        registry nor a stuck pod can stall the poller and freeze the pool's view.
        """
        if list_registry:
            self._listed_at = time.monotonic()
            try:
                entries = await asyncio.wait_for(self._source.discover(),
                                                 self.poll_timeout + 2.0)
            except Exception as exc:  # registry outage: keep polling the pods we know
                log.warning("pod discovery failed, keeping %d known pods: %r",
                            len(self._pods), exc)
            else:
                self._sync(entries)
        now = time.monotonic()
        self._heartbeat_s = max(self.heartbeat_interval, len(self._pods) / MAX_HEARTBEATS_PER_S)
        self._health_s = max(self.health_interval, len(self._pods) / MAX_HEALTH_POLLS_PER_S)
        due = [pod for pod in list(self._pods.values()) if self._poll_due(pod, now)]
        due = longest_unpolled(due, MAX_POLLS_PER_ROUND)
        await asyncio.gather(*(self._poll_bounded(pod) for pod in due))
        if self.watch:
            for pod in due:
                self._start_watch(pod)

    def _poll_due(self, pod: PodRecord, now: float) -> bool:
        """Whether `pod` is polled this round: always, unless its load stream is
        live, and then only every `health_interval` (the health check). A
        silent stream is dropped here and counts as a slow poll."""
        watch = pod.watch
        if watch is None:
            return True
        if not watch.running:
            pod.watch = None
            return True
        if not watch.reports:  # not live until its first report (an old pod says UNIMPLEMENTED)
            return True
        if watch.stale(now):
            self._stop_watch(pod)
            self._poll_failed(pod, f"no load report for {now - watch.last_report_at:.1f} s",
                              slow=True)
            return True
        return now - pod.polled_at >= self._health_s

    def _start_watch(self, pod: PodRecord) -> None:
        if (pod.watch is not None or pod.watch_unsupported or pod.state is not PodState.HEALTHY
                or self._pods.get(pod.entry.address) is not pod):
            return
        pod.watch = LoadWatch(pod.channel, pod.entry.role, min_interval=self.poll_interval,
                              max_interval=self._heartbeat_s,
                              on_report=lambda report: self._streamed(pod, report),
                              on_end=lambda reason, unsupported: self._watch_ended(
                                  pod, reason, unsupported))
        pod.watch.start()

    def _streamed(self, pod: PodRecord, report: pdserve_pb2.LoadReport) -> None:
        self._on_report("stream")
        self._apply(pod, report, "load report")

    def _stop_watch(self, pod: PodRecord) -> None:
        if pod.watch is not None:
            pod.watch.cancel()
            pod.watch = None

    def _watch_ended(self, pod: PodRecord, reason: str, unsupported: bool) -> None:
        pod.watch = None
        if self._pods.get(pod.entry.address) is not pod:
            return
        if unsupported:
            pod.watch_unsupported = True
            log.info("%s pod %s has no WatchLoad: polling it", pod.entry.role,
                     pod.entry.address)
        elif pod.state is PodState.HEALTHY:
            # Poll it now, not take it out: a crashed pod refuses the poll (out at
            # once), a reset but live one answers it, a black-holed one is slow.
            log.info("%s pod %s: %s; polling it now", pod.entry.role, pod.entry.address, reason)
            task = asyncio.create_task(self._repoll(pod))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _repoll(self, pod: PodRecord) -> None:
        await self._poll_bounded(pod)
        if self.watch:
            self._start_watch(pod)

    async def _poll_bounded(self, pod: PodRecord) -> None:
        try:
            await asyncio.wait_for(self._poll(pod), 2 * self.poll_timeout + 1.0)
        except TimeoutError:
            self._poll_failed(pod, "poll did not finish in time", slow=True)

    def _sync(self, entries: list[PodEntry]) -> None:
        wanted = {e.address: e for e in entries}
        now = time.monotonic()
        for address, pod in list(self._pods.items()):
            entry = wanted.get(address)
            if entry == pod.entry:
                if pod.absent_since is not None:
                    log.info("%s pod %s is back in the registry", entry.role, address)
                    pod.absent_since = None
                continue
            if entry is None and self._keep_absent(pod, now):
                continue
            self._pods.pop(address)
            self._views.reset()
            self._stop_watch(pod)
            log.info("%s pod %s left the registry", pod.entry.role, address)
            self._close_channel(pod.channel)
        for address, entry in wanted.items():
            if address not in self._pods:
                log.info("%s pod %s joined the registry", entry.role, address)
                self._views.reset()
                # polls a restarted pod at once (GRPC_RECONNECT_OPTIONS)
                self._pods[address] = PodRecord(entry, pod_channel(address, self._security,
                                                              _POOL_CHANNEL_OPTIONS))

    def _keep_absent(self, pod: PodRecord, now: float) -> bool:
        """Whether a pod missing from the registry stays (see the module docstring)."""
        if pod.state is not PodState.HEALTHY:
            return False
        if pod.absent_since is None:
            pod.absent_since = now
            log.warning("%s pod %s is missing from the registry but answers its polls; "
                        "keeping it for up to %.1f s", pod.entry.role, pod.entry.address,
                        self.absent_grace)
        return now - pod.absent_since < self.absent_grace

    async def _poll(self, pod: PodRecord) -> None:
        pod.polled_at = time.monotonic()
        try:
            health = await health_pb2_grpc.HealthStub(pod.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.poll_timeout
            )
            stub_class = (
                pdserve_pb2_grpc.PrefillStub if pod.entry.role == "prefill"
                else pdserve_pb2_grpc.DecodeStub
            )
            report = await stub_class(pod.channel).GetLoad(
                pdserve_pb2.LoadRequest(), timeout=self.poll_timeout
            )
        except grpc.aio.AioRpcError as exc:
            self._poll_failed(pod, f"{exc.code().name} {exc.details()}",
                              slow=exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED)
            return
        self._on_report("poll")
        if self._pods.get(pod.entry.address) is not pod:
            return  # removed from the registry while we were polling
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            self._stop_watch(pod)
            self._move(pod, PodState.UNHEALTHY, f"health status {health.status}")
        else:
            self._apply(pod, report, "poll ok")

    def _apply(self, pod: PodRecord, report: pdserve_pb2.LoadReport, reason: str) -> None:
        """A report from a poll (after a SERVING health check) or the pod's stream."""
        if self._pods.get(pod.entry.address) is not pod:
            return  # removed from the registry meanwhile
        if report.role != pod.entry.role:
            self._move(pod, PodState.UNHEALTHY,
                       f"registered as {pod.entry.role} but reports role {report.role!r}")
        elif report.draining:
            self._move(pod, PodState.UNHEALTHY, "draining")
        else:
            pod.report = report
            pod.failures = 0
            self._move(pod, PodState.HEALTHY, reason)

    def _poll_failed(self, pod: PodRecord, reason: str, *, slow: bool) -> None:
        """A failed poll: UNHEALTHY at once, unless it was only slow and the
        pod is HEALTHY with fewer than SLOW_POLLS_TOLERATED slow polls before
        it (its last report stays in use meanwhile)."""
        pod.failures += 1
        if slow and pod.state is PodState.HEALTHY and pod.failures <= SLOW_POLLS_TOLERATED:
            log.warning("%s pod %s answered no poll in time (%d in a row); still routed "
                        "until %d: %s", pod.entry.role, pod.entry.address, pod.failures,
                        SLOW_POLLS_TOLERATED + 1, reason)
            return
        self._move(pod, PodState.UNHEALTHY, f"poll failed ({pod.failures} in a row): {reason}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                due = time.monotonic() - self._listed_at >= self.list_interval - 1e-3
                await self.poll_once(list_registry=due)
            except Exception:  # never let one bad poll stop the poller
                log.exception("pod poll failed")

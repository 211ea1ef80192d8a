"""`SimCluster`: many simulated pods in one process, on one event loop.

Who uses it: `pdserve sim` (pdserve/commands/sim.py) runs one until
SIGTERM; tests and `pdserve bench scale` start one and make pods
disappear (`drain`, `kill`). Each pod has its own gRPC port
(sim/pods.py); what the pods share is the process: the event loop, the
`SimFabric` their KV "travels" through (sim/kv_link.py) and, with a Redis
URL, one `SharedHeartbeat` that registers them all (sim/registry.py).

Life cycle: `start()` builds every pod and waits until each serves, then
serves every pod's metrics on one page when the config names a metrics
port (sim/metrics_page.py), then writes the ready file (JSON: the
addresses per role, and the page's address under "metrics"); `stop()` sets
every pod's stop, and each drains as a real pod does (pod/server.py).

Signals: each pod's `PodServer.run` installs its own SIGTERM/SIGINT
handler, so `start()` installs the cluster's after every pod has (a pod
installs its handler in the same event-loop turn in which it starts
serving), and a SIGTERM stops the whole cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass

from pod.server import write_ready_file
from proto.roles import PodRole
from sim.kv_link import SimFabric
from sim.metrics_page import serve_cluster_metrics
from sim.pods import SimPod, SimPodSpec, build_sim_pod
from sim.registry import SharedHeartbeat

log = logging.getLogger(__name__)

# Most simulated pods one process runs; each costs a gRPC server (a listening
# socket, a few tasks) and about 100 KiB.
MAX_PODS = 4000
_STOP_SLACK_S = 10.0


@dataclass(frozen=True, slots=True)
class SimClusterConfig:
    """How many pods of each role, and each role's spec (its `server` is
    the template every pod copies: port 0, so each gets its own)."""

    prefill: int
    decode: int
    colocated: int
    prefill_spec: SimPodSpec
    decode_spec: SimPodSpec
    colocated_spec: SimPodSpec
    ready_file: str | None = None
    heartbeat_ttl_s: float = 6.0
    metrics_port: int | None = None  # None: no page; 0: a free port

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        self._check_counts()

    def _check_counts(self) -> None:
        counts = {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}
        for name, count in counts.items():
            if count < 0:
                raise ValueError(f"--{name} must be >= 0, got {count}")
        total = sum(counts.values())
        if not 1 <= total <= MAX_PODS:
            raise ValueError(f"a simulated cluster runs 1..{MAX_PODS} pods, got {total}")
        if self.prefill and not self.decode:
            raise ValueError("simulated prefill pods need simulated decode pods in the same "
                             "process (their KV lands there): add --decode")

    def specs(self) -> list[SimPodSpec]:
        return ([self.prefill_spec] * self.prefill + [self.decode_spec] * self.decode
                + [self.colocated_spec] * self.colocated)


class SimCluster:
    """The pods of one `pdserve sim` process; event loop only."""

    def __init__(self, config: SimClusterConfig) -> None:
        self.config = config
        self.fabric = SimFabric()
        redis_url = config.decode_spec.server.redis_url
        self.heartbeat = (SharedHeartbeat(redis_url, config.heartbeat_ttl_s)
                          if redis_url else None)
        self.pods: list[SimPod] = []
        self._runs: list[asyncio.Task[int]] = []
        self.stopped = asyncio.Event()
        self._killed: set[str] = set()
        self.metrics_address: str | None = None  # host:port of the merged page, once served
        self._metrics_server = None

    async def start(self) -> None:
        """Every pod serving (and registered), the ready file written."""
        for spec in self.config.specs():
            pod = build_sim_pod(spec, self.fabric, self.heartbeat)
            self.pods.append(pod)
            self._runs.append(asyncio.get_running_loop().create_task(pod.run()))
        waiting = {asyncio.ensure_future(pod.serving.wait()) for pod in self.pods}
        while waiting:
            done, _ = await asyncio.wait(waiting | set(self._runs),
                                         return_when=asyncio.FIRST_COMPLETED)
            ended = [run for run in self._runs if run.done()]
            if ended:  # a pod that ends before it serves failed to start
                for future in waiting:
                    future.cancel()
                await self.stop()
                error = ended[0].exception() if not ended[0].cancelled() else None
                raise RuntimeError(f"a simulated pod failed to start: {error!r}")
            waiting -= done
        self._handle_signals()
        ready: dict = self.addresses()
        if self.config.metrics_port is not None:
            host = self.config.decode_spec.server.host
            self._metrics_server, port = serve_cluster_metrics(
                lambda: [(p.address, p.metrics.registry) for p in list(self.pods)],
                host, self.config.metrics_port)
            self.metrics_address = ready["metrics"] = f"{host}:{port}"
        if self.config.ready_file:
            write_ready_file(self.config.ready_file, ready)
        log.info("simulated cluster serving: %s", ", ".join(
            f"{len(a)} {role}" for role, a in self.addresses().items()))

    def addresses(self) -> dict[str, list[str]]:
        """Serving pods' gRPC addresses per role."""
        by_role: dict[str, list[str]] = {r.value: [] for r in PodRole}
        for pod in self.pods:
            if not pod.stop.is_set():
                by_role[pod.spec.role].append(pod.address)
        return by_role

    def _handle_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, self.stopped.set)

    def pod(self, address: str) -> SimPod:
        for pod in self.pods:
            if pod.address == address:
                return pod
        raise ValueError(f"no simulated pod serves at {address}")

    async def drain(self, addresses: list[str]) -> None:
        """Those pods drain and stop as on SIGTERM (their keys deleted)."""
        for address in addresses:
            self.pod(address).stop.set()

    async def kill(self, addresses: list[str]) -> None:
        """Those pods disappear as on a crash (their keys expire)."""
        self._killed.update(addresses)
        await asyncio.gather(*(self.pod(address).kill() for address in addresses))

    async def run_until_stopped(self) -> int:
        """`pdserve sim`: serve until SIGTERM/SIGINT, then stop every pod."""
        await self.stopped.wait()
        return await self.stop()

    async def stop(self) -> int:
        """Every pod drains and stops; 0 when every pod exited cleanly."""
        for pod in self.pods:
            pod.stop.set()
        # A pod's drain is bounded by its grace period; past it (plus the
        # server's own stop) a pod still stopping is stuck, and one stuck pod
        # must not hold the process: it is cancelled, and named.
        bound = self.config.decode_spec.server.grace_period_s + _STOP_SLACK_S
        _, stuck = await asyncio.wait(self._runs, timeout=bound)
        for run in stuck:
            run.cancel()
        if stuck:
            log.warning("%d simulated pod(s) had not stopped %.0fs after the stop; cancelled "
                        "(seen: a cache-event publisher's close waiting on a Redis publish)",
                        len(stuck), bound)
        statuses = await asyncio.gather(*self._runs, return_exceptions=True)
        if self.heartbeat is not None:
            self.heartbeat.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        clean = all(status == 0 for pod, status in zip(self.pods, statuses, strict=True)
                    if pod.address not in self._killed)  # a killed pod exits 1, as it should
        return 0 if clean else 1

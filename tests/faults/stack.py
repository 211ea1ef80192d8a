"""A P/D stack with a fault proxy on every link, and what "back to baseline" means.

    router -> [prefill_grpc proxy] -> prefill pod --KV--> [kv proxy] -> decode pod
           -> [decode_grpc proxy] -> decode pod

The decode pod binds its KV port on 127.0.0.1 and advertises 127.0.0.2
(`--advertise-host`), so the prefill pod dials the KV proxy listening on
127.0.0.2 at the same port; the router is given the gRPC proxies' addresses.
Every byte between the parts therefore crosses a proxy the test controls.
A second decode pod with the gRPC KV connector (`grpc_decode`, outside the
router, tests drive it as the router would) has its own KV proxy
(`grpc_kv`), for that connector's faults and the fuzzing of KVTransfer.

Baseline: per pod, its KV blocks all free, nothing running or waiting, no
landing bytes in use (GetLoad and /metrics), and its OS threads and open
sockets (from /proc) no more than after warm-up (threads: up to THREAD_SLACK more,
for pools that grow lazily; see there).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from tests.faults.proxy import FaultProxy
from tests.integration.flows import load
from tests.integration.pods import PodProcess
from tests.router.router_process import RouterProcess

# Threads a pod may hold above its baseline: its lazily grown pools (asyncio's
# default executor, the gRPC servers' and the engine's OpenMP team for a new
# calling thread) start a worker only when a task finds the others busy,
# which CPU contention decides; twice in full-suite runs on the 2-core CI
# machine a pod held one more thread than at baseline, for good, after a
# fuzz test. That is a pool at a new size, not a leak: a thread leaked per
# request or per fault would pass the slack within a few tests and fail
# them (the message lists the threads by name).
THREAD_SLACK = 2


@dataclass(frozen=True)
class Usage:
    threads: int
    sockets: int
    # Thread names and how many of each, for the failure message only.
    names: tuple[tuple[str, int], ...] = field(default=(), compare=False)


def usage(pid: int) -> Usage:
    """OS threads and open sockets of process `pid` (Linux /proc)."""
    names: dict[str, int] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm", encoding="utf-8") as f:
                name = f.read().strip()
        except OSError:  # ended while listing
            continue
        names[name] = names.get(name, 0) + 1
    sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:  # closed while listing
            pass
    return Usage(sum(names.values()), sockets, tuple(sorted(names.items())))


def tcp_sockets(pid: int) -> list[tuple[int, int, str] | None]:
    """Each open socket of `pid`: (local port, remote port, TCP state), or
    None for one that is not TCP (Unix, UDP). Linux /proc."""
    tcp: dict[str, tuple[int, int, str]] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, remote = (int(c.rpartition(":")[2], 16) for c in cols[1:3])
            tcp[cols[9]] = (local, remote, _TCP_STATES.get(cols[3], cols[3]))
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed while listing
            continue
        if link.startswith("socket:["):
            found.append(tcp.get(link[8:-1]))
    return found


def socket_peers(pid: int) -> list[str]:
    """`tcp_sockets` as text, for a failure message: which link is held."""
    return sorted("not tcp" if s is None else f"tcp {s[0]}->{s[1]} {s[2]}"
                  for s in tcp_sockets(pid))


def links_to(pid: int, port: int) -> int:
    """How many established connections process `pid` holds to `port`."""
    return sum(1 for s in tcp_sockets(pid) if s is not None and s[1] == port
               and s[2] == "ESTABLISHED")


_TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN",
               "07": "CLOSE", "04": "FIN_WAIT1", "05": "FIN_WAIT2", "09": "LAST_ACK"}


@dataclass
class FaultStack:
    prefill: PodProcess
    decode: PodProcess
    router: RouterProcess
    kv: FaultProxy
    prefill_grpc: FaultProxy
    decode_grpc: FaultProxy
    baseline: dict[str, Usage]
    grpc_decode: PodProcess  # outside the router: a decode pod with the gRPC KV connector
    grpc_kv: FaultProxy  # in front of grpc_decode's KV port (it advertises 127.0.0.2 too)
    # the same pods behind a second router that splits a long prompt across
    # them (its default, auto: on for CPU decode pods); `router` does not
    split_router: RouterProcess | None = None

    @property
    def proxies(self) -> tuple[FaultProxy, ...]:
        return (self.kv, self.prefill_grpc, self.decode_grpc, self.grpc_kv)

    def pods(self) -> dict[str, PodProcess]:
        return {"prefill": self.prefill, "decode": self.decode, "grpc_decode": self.grpc_decode}

    def record_baseline(self) -> None:
        self.baseline = {name: usage(pod.process.pid) for name, pod in self.pods().items()}

    def heal(self) -> None:
        """No fault on any link, and no connection left from a faulty one."""
        for proxy in self.proxies:
            proxy.heal()


def idle_report(pod: PodProcess) -> tuple[int, int, int, int, float]:
    """(free blocks, total blocks, running, waiting, landing bytes) of `pod`."""
    report = load(pod.address, "Decode" if pod.role == "decode" else "Prefill")
    landing = pod.metric_value("pdserve_kv_landing_bytes_in_use") if pod.role == "decode" else 0
    return (report.num_free_blocks, report.num_total_blocks, report.num_running,
            report.num_waiting, landing)


def assert_back_to_baseline(stack: FaultStack, timeout: float = 20.0) -> None:
    """Wait (bounded) until every pod holds nothing and uses no more threads
    or sockets than at baseline; fail with what is still held."""
    assert_pods_at_baseline(stack.pods(), stack.baseline, timeout)


def assert_pods_at_baseline(pods: dict[str, PodProcess], baseline: dict[str, Usage],
                            timeout: float = 20.0) -> None:
    """`assert_back_to_baseline` for any pods, against `baseline` (from `usage`)."""
    deadline = time.monotonic() + timeout
    while True:
        held = {}
        for name, pod in pods.items():
            free, total, running, waiting, landing = idle_report(pod)
            now = usage(pod.process.pid)
            base = baseline[name]
            if (free, running, waiting, landing) != (total, 0, 0, 0) or (
                    now.threads > base.threads + THREAD_SLACK or now.sockets > base.sockets):
                held[name] = dict(free=free, total=total, running=running, waiting=waiting,
                                  landing=landing, usage=now, baseline=base,
                                  sockets=socket_peers(pod.process.pid))
        if not held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not back to baseline after {timeout}s: {held}")
        time.sleep(0.05)

"""`serve_workers`: N router worker processes on one HTTP and one gRPC port.

Each worker is a whole `RouterServer` (its own event loop, pod channels,
Decode.Session per pod, poller) in its own process, so the relay's CPU
spreads over N cores. The ports are shared with SO_REUSEPORT: the kernel
spreads new connections over the workers' listening sockets.

    supervisor (this process, started by `pdserve router --workers N`)
      reserve the HTTP and gRPC ports (a bound, non-listening SO_REUSEPORT
        socket each: port 0 becomes one concrete port every worker binds)
      spawn N workers ──> each: RouterServer.start() ──> "ready" (ports)
      all ready ──> on_ready(http_port, grpc_port)
      SIGTERM / SIGINT ──> SIGTERM to every worker; each drains its own
        in-flight requests (--shutdown-grace) and exits; exit 0 when all did
      a worker dies on its own ──> SIGTERM the others, exit 1: the router
        is restarted as a whole by whoever runs it (systemd, Kubernetes),
        which also makes a crash loop visible instead of hiding it

Shared state: the pod registry is per worker (each polls the pods); the
session map is shared only through Redis (`--redis-url`). Without Redis
each worker keeps its own map: rendezvous hashing still sends a session to
the same pod from every worker, but a move off an overloaded pod is known
only to the worker that made it. Metrics: prometheus_client's multiprocess
mode over `RouterConfig.metrics_dir` (the CLI sets it up); any worker's
/metrics sums every worker's samples. Traces: the supervisor makes no spans
and sets up no tracing; each worker, once spawned, sets up its own tracer
provider and exporter (`setup_tracing`, telemetry.tracing.setup), with
service.instance.id `<address>/worker-<i>`. A request's spans come from the
worker that served it, and `pdserve trace ID` from that worker's history.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import queue
import signal
import socket
import time
from collections.abc import Callable

from router.config import RouterConfig

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0


def _reserve_port(host: str, port: int) -> socket.socket:
    """A bound (not listening) SO_REUSEPORT socket holding `port` (0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _worker(config: RouterConfig, index: int, log_level: str,
            ready: multiprocessing.Queue, setup_tracing: Callable[..., bool] | None) -> None:
    """One worker process: a RouterServer until SIGTERM."""
    die_with_parent()
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [worker {index}] %(name)s: %(message)s")
    from router.server import RouterServer
    from telemetry import tracing

    def started(server: RouterServer) -> None:
        ready.put((index, server.http_port, server.grpc_port))

    if setup_tracing is not None:  # this process's own provider, made after the spawn
        setup_tracing(instance=f"worker-{index}")
    try:
        asyncio.run(RouterServer(config).run_until_signal(started))
    finally:
        tracing.shutdown()  # the drained requests' spans leave before the worker exits


def die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies, even by SIGKILL (a
    router worker, and the children of `pdserve up`, which run it before exec)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def serve_workers(config: RouterConfig, *, log_level: str,
                  on_ready: Callable[[int, int], None],
                  setup_tracing: Callable[..., bool] | None = None) -> int:
    """Run `config.workers` workers until SIGTERM; the process exit status.
    `setup_tracing` (picklable: a functools.partial of telemetry.tracing.setup
    with its config and identity) is called in each worker with
    `instance="worker-<i>"`; None: no worker traces."""
    if config.workers < 2:
        raise ValueError(f"serve_workers needs workers >= 2, got {config.workers}")
    http_sock = _reserve_port(config.host, config.port)
    grpc_sock = _reserve_port(config.host, config.grpc_port)
    config = dataclasses.replace(config, port=http_sock.getsockname()[1],
                                 grpc_port=grpc_sock.getsockname()[1])
    context = multiprocessing.get_context("spawn")
    ready: multiprocessing.Queue = context.Queue()
    workers = [context.Process(target=_worker,
                               args=(config, i, log_level, ready, setup_tracing),
                               name=f"pdserve-router-{i}") for i in range(config.workers)]
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        for worker in workers:
            worker.start()
        if not _wait_ready(workers, ready, lambda: stopping):
            stopping = True
            return 1
        on_ready(config.port, config.grpc_port)
        log.info("router: %d workers on HTTP %s:%d and gRPC %s:%d", len(workers), config.host,
                 config.port, config.host, config.grpc_port)
        while not stopping:
            multiprocessing.connection.wait([w.sentinel for w in workers], timeout=0.5)
            dead = [w for w in workers if w.exitcode is not None]
            if dead and not stopping:
                log.error("router worker %s exited with status %s; stopping the router",
                          dead[0].name, dead[0].exitcode)
                return 1
        log.info("router: signal received, draining %d workers", len(workers))
        return 0 if _stop(workers, config.shutdown_grace) else 1
    finally:
        _stop(workers, config.shutdown_grace)
        _mark_dead(workers, config.metrics_dir)
        http_sock.close()
        grpc_sock.close()


def _wait_ready(workers: list[multiprocessing.Process], ready: multiprocessing.Queue,
                stopping: Callable[[], bool]) -> bool:
    pending = set(range(len(workers)))
    deadline = time.monotonic() + _START_TIMEOUT_S
    while pending:
        if stopping():
            return False
        try:
            index, _, _ = ready.get(timeout=0.2)
            pending.discard(index)
            continue
        except queue.Empty:
            pass
        dead = [w for w in workers if w.exitcode is not None]
        if dead or time.monotonic() > deadline:
            why = f"exited with status {dead[0].exitcode}" if dead else "did not start in time"
            log.error("router worker %s %s", (dead or workers)[0].name, why)
            return False
    return True


def _stop(workers: list[multiprocessing.Process], grace: float) -> bool:
    """SIGTERM every live worker, wait for each (grace + margin), kill leftovers.
    True when every worker exited with status 0."""
    for worker in workers:
        if worker.exitcode is None and worker.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                worker.terminate()  # SIGTERM: the worker drains
    deadline = time.monotonic() + grace + 10.0
    for worker in workers:
        if worker.pid is None:
            continue
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.exitcode is None:
            log.error("router worker %s ignored SIGTERM; killing it", worker.name)
            worker.kill()
            worker.join()
    return all(w.exitcode == 0 for w in workers if w.pid is not None)


def _mark_dead(workers: list[multiprocessing.Process], metrics_dir: str | None) -> None:
    if metrics_dir is None:
        return
    from prometheus_client import multiprocess

    for worker in workers:
        if worker.pid is not None:
            multiprocess.mark_process_dead(worker.pid, metrics_dir)

"""`PodServer`: one pod's gRPC server with health, metrics, ready file,
registry heartbeat and the serve-until-SIGTERM-then-drain loop.

Assembled by the prefill pod (`prefill_service.server`), the decode pod and
the colocated pod (`decode_service.server`). Everything here runs on the
pod's asyncio loop, except `write_ready_file` and the metrics HTTP server
thread.

Shutdown (SIGTERM or SIGINT):

    SERVING --signal--> DRAINING (health NOT_SERVING, new RPCs -> UNAVAILABLE,
                                  heartbeat stopped, in-flight RPCs continue)
            --in-flight done or grace period over--> STOPPED (server stopped, exit 0)

A pod whose engine loop died takes the same path on its own and exits 1.

The gRPC port serves TLS and requires the pod token as `config.security`
says (proto/tls.py; the server is built with `new_grpc_server(security)`);
with `config.health_port` the health service is also served alone, in
plaintext, for probes that cannot speak TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pod.cache_events import CacheEventHub
from pod.config import ServerConfig
from pod.drain import DrainGate, DrainState
from proto.limits import GRPC_MESSAGE_OPTIONS
from proto.roles import PodRole
from proto.tls import PodSecurity, add_port, server_interceptors

log = logging.getLogger(__name__)


def write_ready_file(path: str, ports: dict[str, int]) -> None:
    """Write {"grpc": .., "metrics": .., "kv": ..} atomically (tests poll for it)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(ports), encoding="utf-8")
    os.replace(tmp, path)


def is_loopback(host: str) -> bool:
    """Whether `host` (the address the pod binds) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost
        return False


def security_warning(role: str, host: str, port: int, security: PodSecurity) -> str | None:
    """What the start-up log must warn about when the pod's gRPC port
    authenticates no caller (None when it does): anyone who can reach the port
    may then reserve KV blocks, run prompts, abort others' requests and read
    the pod's cache events. Said at WARNING so it is seen, unless the pod binds
    a loopback address: plaintext is the CLI's default, for loopback set-ups
    (`pdserve up`, tests); the Helm chart turns authentication on by default
    (docs/deploy.md, Security)."""
    if security.tls is None:
        return (f"{role} pod gRPC on {host}:{port} is plaintext and unauthenticated: anyone "
                "who can reach this port can call it. Serve it with --tls-cert-file, "
                "--tls-key-file and --tls-ca-file (mutual TLS), or TLS and --pod-token-file "
                "(docs/deploy.md, Security)")
    if not security.tls.mutual and security.token is None:
        return (f"{role} pod gRPC on {host}:{port} is encrypted but authenticates no caller: "
                "add --tls-ca-file (client certificates) or --pod-token-file "
                "(docs/deploy.md, Security)")
    return None


@dataclass(slots=True)
class PodServer:
    """One pod's gRPC server, assembled by the role's `server.py`.

    `services` are the fully qualified names health reports on (besides "");
    `on_stopped` callbacks run after the gRPC server stopped (engine loop,
    KV sender/receiver shutdown), in order.
    """

    role: PodRole
    model: str
    config: ServerConfig
    gate: DrainGate
    server: grpc.aio.Server
    services: tuple[str, ...]
    extra_ports: dict[str, int] = field(default_factory=dict)
    on_stopped: list[Callable[[], None]] = field(default_factory=list)
    metrics_start: Callable[[str, int], int] | None = None
    # False once the pod cannot serve any more (its engine loop died): the
    # pod then reports NOT_SERVING, stops, and exits 1 so it is restarted.
    alive: Callable[[], bool] = lambda: True
    # The pod's prefix-cache events (pod/cache_events.py), told the pod's
    # address once it serves and closed when it stops.
    cache_events: CacheEventHub | None = None
    _health: health_aio.HealthServicer = field(default_factory=health_aio.HealthServicer)

    @staticmethod
    def new_grpc_server(security: PodSecurity | None = None) -> grpc.aio.Server:
        """The pod's gRPC server; with a pod token every call but health checks
        must carry it (proto/tls.py)."""
        return grpc.aio.server(options=list(GRPC_MESSAGE_OPTIONS),
                               interceptors=server_interceptors(security or PodSecurity()))

    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Serve until SIGTERM/SIGINT (or `stop` is set), drain, stop; returns 0."""
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        security = self.config.security
        port = add_port(self.server, f"{self.config.host}:{self.config.port}", security.tls)
        await self.server.start()
        log.info("%s pod gRPC: %s", self.role, security.describe())
        if (warning := security_warning(self.role, self.config.host, port, security)) is not None:
            # on loopback (`pdserve up`, tests) only this host can call it: not worth a warning
            log.log(logging.INFO if is_loopback(self.config.host) else logging.WARNING,
                    "%s", warning)
        health_server = await self._start_health_server()
        for name in ("", *self.services):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        ports = {"grpc": port, **self.extra_ports}
        if health_server is not None:
            ports["health"] = health_server[1]
        if self.metrics_start is not None:
            ports["metrics"] = self.metrics_start(self.config.host, self.config.metrics_port)
        log.info("%s pod serving: %s", self.role,
                 ", ".join(f"{k}={v}" for k, v in ports.items()))
        heartbeat = self._start_heartbeat(port)
        if self.cache_events is not None:
            self.cache_events.start(
                f"{self.config.public_host()}:{port}" if self.config.redis_url else "")
        if self.config.ready_file:
            write_ready_file(self.config.ready_file, {"kv": 0, **ports})

        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, stop.set)
        watchdog = asyncio.create_task(self._watch(stop))
        await stop.wait()
        watchdog.cancel()
        failed = not self.alive()
        await self._drain(heartbeat)
        if health_server is not None:
            await health_server[0].stop(grace=None)
        # Already shutting down: a repeated SIGTERM after the event loop (and
        # its handlers) is gone must not turn the clean exit into a kill.
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread (tests)
                signal.signal(signum, signal.SIG_IGN)
        return 1 if failed else 0

    async def _start_health_server(self) -> tuple[grpc.aio.Server, int] | None:
        """With --health-port: the health service alone, in plaintext, for
        probes that cannot speak TLS (kubelet's gRPC probe). It says SERVING
        or NOT_SERVING, nothing else, so it needs no authentication."""
        if self.config.health_port is None:
            return None
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        port = add_port(server, f"{self.config.host}:{self.config.health_port}", None)
        await server.start()
        return server, port

    async def _watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not self.alive():
                log.error("%s pod can no longer serve (engine loop stopped); shutting down",
                          self.role)
                stop.set()
                return
            await asyncio.sleep(0.5)

    async def _drain(self, heartbeat: object | None) -> None:
        log.info("%s pod draining: %d request(s) in flight, grace period %.1fs",
                 self.role, self.gate.in_flight, self.config.grace_period_s)
        self.gate.transition(DrainState.DRAINING)
        await self._health.enter_graceful_shutdown()
        if heartbeat is not None:
            heartbeat.stop()
        if not await self.gate.wait_idle(self.config.grace_period_s):
            log.warning("%s pod: grace period over with %d request(s) in flight",
                        self.role, self.gate.in_flight)
        if self.cache_events is not None:
            await self.cache_events.close()  # ends the subscriptions before the stop
        await self.server.stop(grace=1.0)
        self.gate.transition(DrainState.STOPPED)
        for callback in self.on_stopped:
            try:
                callback()
            except Exception:  # noqa: BLE001 - keep shutting the rest down
                log.exception("%s pod: shutdown step failed", self.role)
        log.info("%s pod stopped", self.role)

    def _start_heartbeat(self, port: int) -> object | None:
        if not self.config.redis_url:
            return None
        # Imported only when asked for: the heartbeat pulls in redis.
        from pod.heartbeat import PodHeartbeat

        heartbeat = PodHeartbeat(self.config.redis_url, role=self.role,
                                 address=f"{self.config.public_host()}:{port}", model=self.model)
        heartbeat.start()
        return heartbeat

"""What every pod process shares around its servicers: the listening
settings, the drain gate, the load report, and the serve-until-SIGTERM loop.

Used by the prefill pod (`prefill_service.server`), the decode pod and the
colocated pod (`decode_service.server`); it lives here because the prefill
service is the lower of the two service packages (decode imports it, never
the reverse). Everything here runs on the pod's asyncio loop, except
`write_ready_file` and the metrics HTTP server thread.

Shutdown (SIGTERM or SIGINT):

    SERVING --signal--> DRAINING (health NOT_SERVING, new RPCs -> UNAVAILABLE,
                                  heartbeat stopped, in-flight RPCs continue)
            --in-flight done or grace period over--> STOPPED (server stopped, exit 0)

A pod whose engine loop died takes the same path on its own and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from engine.outputs import EngineStats
from proto import pdserve_pb2
from proto.status import ServiceError

log = logging.getLogger(__name__)

# KV frames over the gRPC connector and long prompts' token lists exceed
# gRPC's 4 MiB default; 256 MiB bounds a single message, not a transfer.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where a pod listens and how it announces itself; part of every pod config."""

    host: str = "0.0.0.0"
    port: int = 0
    metrics_port: int = 0
    advertise_host: str | None = None
    redis_url: str | None = None
    grace_period_s: float = 30.0
    ready_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535] (0 = any free port), got {value}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace period must be >= 0 seconds, got {self.grace_period_s}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://",
                                                                         "unix://")):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://, "
                             f"got {self.redis_url!r}")

    def public_host(self) -> str:
        """The host peers should dial: --advertise-host, else the bind host,
        else (bound to a wildcard) this machine's address."""
        if self.advertise_host:
            return self.advertise_host
        if self.host not in _WILDCARD_HOSTS:
            return self.host
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


class PodState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


_POD_TRANSITIONS = {
    PodState.SERVING: frozenset({PodState.DRAINING, PodState.STOPPED}),
    PodState.DRAINING: frozenset({PodState.STOPPED}),
    PodState.STOPPED: frozenset(),
}


class DrainGate:
    """Admits RPCs while SERVING and counts those in flight, so shutdown can
    wait for them. Used only on the pod's event loop (no locking needed)."""

    def __init__(self) -> None:
        self.state = PodState.SERVING
        self.in_flight = 0
        self._idle: asyncio.Event | None = None

    @property
    def draining(self) -> bool:
        return self.state is not PodState.SERVING

    def transition(self, new: PodState) -> None:
        if new not in _POD_TRANSITIONS[self.state]:
            raise RuntimeError(f"pod state {self.state.value} -> {new.value} is not allowed")
        self.state = new

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Wrap one RPC's work; UNAVAILABLE once the pod drains."""
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               "pod is shutting down and takes no new requests; use another pod")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no RPC is in flight, False when `timeout` passed first."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


def write_ready_file(path: str, ports: dict[str, int]) -> None:
    """Write {"grpc": .., "metrics": .., "kv": ..} atomically (tests poll for it)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(ports), encoding="utf-8")
    os.replace(tmp, path)


@dataclass(slots=True)
class PodServer:
    """One pod's gRPC server, assembled by the role's `server.py`.

    `services` are the fully qualified names health reports on (besides "");
    `on_stopped` callbacks run after the gRPC server stopped (engine loop,
    KV sender/receiver shutdown), in order.
    """

    role: str
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
    _health: health_aio.HealthServicer = field(default_factory=health_aio.HealthServicer)

    @staticmethod
    def new_grpc_server() -> grpc.aio.Server:
        return grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ])

    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Serve until SIGTERM/SIGINT (or `stop` is set), drain, stop; returns 0."""
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        await self.server.start()
        for name in ("", *self.services):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        ports = {"grpc": port, **self.extra_ports}
        if self.metrics_start is not None:
            ports["metrics"] = self.metrics_start(self.config.host, self.config.metrics_port)
        log.info("%s pod serving: %s", self.role,
                 ", ".join(f"{k}={v}" for k, v in ports.items()))
        heartbeat = self._start_heartbeat(port)
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
        # Already shutting down: a repeated SIGTERM after the event loop (and
        # its handlers) is gone must not turn the clean exit into a kill.
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread (tests)
                signal.signal(signum, signal.SIG_IGN)
        return 1 if failed else 0

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
        self.gate.transition(PodState.DRAINING)
        await self._health.enter_graceful_shutdown()
        if heartbeat is not None:
            heartbeat.stop()
        if not await self.gate.wait_idle(self.config.grace_period_s):
            log.warning("%s pod: grace period over with %d request(s) in flight",
                        self.role, self.gate.in_flight)
        await self.server.stop(grace=1.0)
        self.gate.transition(PodState.STOPPED)
        for callback in self.on_stopped:
            try:
                callback()
            except Exception:  # noqa: BLE001 - keep shutting the rest down
                log.exception("%s pod: shutdown step failed", self.role)
        log.info("%s pod stopped", self.role)

    def _start_heartbeat(self, port: int) -> object | None:
        if not self.config.redis_url:
            return None
        # Imported only when asked for: the registry pulls in redis.
        from pdserve.registry import PodHeartbeat

        heartbeat = PodHeartbeat(self.config.redis_url, role=self.role,
                                 address=f"{self.config.public_host()}:{port}", model=self.model)
        heartbeat.start()
        return heartbeat


def load_report(*, role: str, generation: int, model: str, max_model_len: int, block_size: int,
                stats: EngineStats, draining: bool) -> pdserve_pb2.LoadReport:
    """`GetLoad`'s answer from an `engine.engine_loop.EngineStats` snapshot."""
    return pdserve_pb2.LoadReport(
        role=role,
        generation=generation,
        num_waiting=stats.num_waiting,
        num_waiting_tokens=stats.num_waiting_tokens,
        num_running=stats.num_running,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        block_size=block_size,
        prefix_hit_rate=(stats.prefix_cache_hits / stats.prefix_cache_queries
                         if stats.prefix_cache_queries else 0.0),
        model=model,
        max_model_len=max_model_len,
        draining=draining,
    )

"""One simulated pod: the real servicers and `PodServer` over a
`SimEngineLoop`, with the simulated KV link.

Who uses it: sim/cluster.py starts many of these on one event loop
(`pdserve sim`); tests start a few. A simulated pod of each role serves
what the real pod of that role serves, from the same code:

* prefill: `PrefillServicer` (prefill_service/servicer.py) with a
  `SimExport` for its `KVExport`;
* decode: `DecodeServicer` (decode_service/servicer.py) whose `KVImport`s
  use a `SimReceiver` / `SimInjector` for the receiver and injector;
* colocated: `DecodeServicer` without remote KV;

and every role: `CacheEvents` from the engine's real prefix cache
(pod/cache_events.py), `GetLoad` (pod/load.py), health, drain on stop
(pod/drain.py, pod/server.py). Differences from a real pod, each because
hundreds share a process: no per-pod metrics HTTP server (the metrics
are still kept, `SimPod.metrics`), no ready file per pod (the cluster
writes one for all), and the Redis registration is the process's
`SharedHeartbeat` (sim/registry.py) instead of a thread per pod.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from decode_service.kv_import import RemoteKV
from decode_service.servicer import DecodeServicer
from engine.engine_loop import LoopState
from engine.metrics import PodMetrics
from pod.cache_events import add_cache_events
from pod.config import ServerConfig
from pod.drain import DrainGate
from pod.kv_shape import KVShape
from pod.messages import ModelLimits
from pod.server import PodServer
from prefill_service.servicer import PrefillServicer
from proto import pdserve_pb2_grpc
from proto.registry import PodRecord
from proto.roles import PodRole
from sim.engine import SimEngine, SimEngineConfig
from sim.engine_loop import SimEngineLoop
from sim.kv_link import SimExport, SimFabric, SimInjector, SimReceiver
from sim.perf_model import PerfModel
from sim.registry import SharedHeartbeat


@dataclass(frozen=True, slots=True)
class SimModel:
    """The served model as the pods and the router see it: its name, token
    limits and per-token KV shape (what a real pod reads from config.json)."""

    name: str
    vocab_size: int
    max_model_len: int
    kv_shape: KVShape


@dataclass(frozen=True, slots=True)
class SimPodSpec:
    """One simulated pod: its role, model, performance and engine sizes."""

    role: str
    model: SimModel
    perf: PerfModel
    block_size: int
    num_blocks: int
    prefix_cache: bool
    server: ServerConfig
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    mixed_prefill_tokens: int = 0
    transfer_timeout_s: float = 30.0
    reservation_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        PodRole.parse(self.role, "simulated pod role")

    def engine_config(self) -> SimEngineConfig:
        return SimEngineConfig(
            vocab_size=self.model.vocab_size, max_model_len=self.model.max_model_len,
            num_blocks=self.num_blocks, block_size=self.block_size,
            enable_prefix_caching=self.prefix_cache, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            mixed_prefill_tokens=self.mixed_prefill_tokens)


def blocks_for(perf: PerfModel, kv_shape: KVShape, block_size: int) -> int:
    """How many blocks the profile's `kv_cache_bytes` hold (a real pod's
    `--kv-cache-memory`)."""
    num_blocks = perf.kv_cache_bytes // (block_size * kv_shape.bytes_of(1))
    if num_blocks < 1:
        raise ValueError(f"profile {perf.name!r}: kv_cache_bytes {perf.kv_cache_bytes} hold "
                         f"no block of {block_size} tokens")
    return num_blocks


class _Registration:
    """What `PodServer._drain` stops: the pod's key in the shared heartbeat.
    A killed pod's key is only no longer refreshed (it expires, as a
    crashed pod's does)."""

    def __init__(self, heartbeat: SharedHeartbeat, record: PodRecord) -> None:
        self._heartbeat, self._record = heartbeat, record
        self.killed = False
        heartbeat.add(record)

    def kill(self) -> None:
        self.killed = True
        self._heartbeat.forget(self._record)

    def stop(self) -> None:
        if not self.killed:
            self._heartbeat.remove(self._record)


@dataclass(slots=True)
class SimPodServer(PodServer):
    """`PodServer` whose registration is the process's shared heartbeat;
    `on_serving(port)` runs once the gRPC port is bound (before the pod's
    key is written)."""

    on_serving: Callable[[int], None] = lambda port: None
    heartbeat: SharedHeartbeat | None = None
    registration: _Registration | None = None

    def _start_heartbeat(self, port: int) -> object | None:
        self.on_serving(port)
        if self.heartbeat is None or not self.config.redis_url:
            return None
        address = f"{self.config.public_host()}:{port}"
        self.registration = _Registration(self.heartbeat, PodRecord(
            address=address, role=self.role, model=self.model, started_at=time.time()))
        return self.registration


@dataclass(slots=True)
class SimPod:
    """A simulated pod, built by `build_sim_pod`; `run(stop)` serves it."""

    spec: SimPodSpec
    loop: SimEngineLoop
    server: SimPodServer
    metrics: PodMetrics
    address: str = ""
    serving: asyncio.Event = field(default_factory=asyncio.Event)

    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> int:
        """Serve until `stop` is set, then drain (pod/server.py)."""
        self.loop.start()
        await self.server.cache_events.attach(self.loop)
        return await self.server.run(self.stop)

    async def kill(self) -> None:
        """Disappear as a crashed pod does: open RPCs end at once, the
        registry key is no longer refreshed (it expires), nothing drains."""
        if self.server.registration is not None:
            self.server.registration.kill()
        await self.server.server.stop(grace=None)
        self.loop.stop()
        self.stop.set()


def build_sim_pod(spec: SimPodSpec, fabric: SimFabric,
                  heartbeat: SharedHeartbeat | None = None) -> SimPod:
    """Assemble one simulated pod of `spec.role` (on the running event loop)."""
    role, model = spec.role, spec.model
    metrics = PodMetrics.create(role)
    loop = SimEngineLoop(SimEngine(spec.engine_config()), spec.perf, metrics)
    gate = DrainGate()
    generation = secrets.randbits(63)
    grpc_server = PodServer.new_grpc_server(spec.server.security)
    cache_events = add_cache_events(grpc_server, role=role, generation=generation,
                                    engine_loop=loop, redis_url=spec.server.redis_url)
    limits = ModelLimits(model.vocab_size, model.max_model_len)
    receiver: SimReceiver | None = None
    if role == PodRole.PREFILL:
        servicer = PrefillServicer(
            loop=loop, export=SimExport(fabric, spec.perf), metrics=metrics, gate=gate,
            limits=limits, kv_shape=model.kv_shape, model=model.name, generation=generation,
            cache_events_channel=cache_events.channel)
        pdserve_pb2_grpc.add_PrefillServicer_to_server(servicer, grpc_server)
        services = ("pdserve.v1.Prefill",)
    else:
        remote = None
        if role == PodRole.DECODE:
            injector = SimInjector(metrics.kv_transfer_bytes)
            receiver = SimReceiver("", generation, injector)
            remote = RemoteKV(receiver, injector, model.kv_shape, spec.transfer_timeout_s,
                              spec.reservation_timeout_s)
        decode = DecodeServicer(role=role, loop=loop, metrics=metrics, gate=gate, limits=limits,
                                model=model.name, generation=generation, remote=remote,
                                cache_events_channel=cache_events.channel)
        pdserve_pb2_grpc.add_DecodeServicer_to_server(decode, grpc_server)
        services = ("pdserve.v1.Decode",)
    pod = SimPod(spec, loop, None, metrics)  # type: ignore[arg-type] - set below

    def on_serving(port: int) -> None:
        pod.address = f"{spec.server.public_host()}:{port}"
        if receiver is not None:  # its KV endpoint is the pod's own address
            receiver.endpoint = pod.address
            fabric.attach(receiver)
        pod.serving.set()

    def on_stopped() -> None:
        loop.stop()
        if receiver is not None:
            fabric.detach(receiver)

    pod.server = SimPodServer(
        role=role, model=model.name, config=spec.server, gate=gate, server=grpc_server,
        services=services, on_stopped=[on_stopped],
        alive=lambda: loop.state is LoopState.RUNNING, cache_events=cache_events,
        on_serving=on_serving, heartbeat=heartbeat)
    return pod

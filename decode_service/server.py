"""Assembles and runs a decode pod (engine + KV receiver + injector) or a
colocated pod (engine only) behind `DecodeServicer`, until SIGTERM.

Called by `pdserve decode` / `pdserve serve` with a validated config; runs in
the caller's asyncio loop, plus the engine loop thread, the receiver's I/O
threads and the injector thread.

A decode pod at TP=b > 1 (docs/tensor_parallel.md, "Decode ranks"): every
worker rank runs its own receiver and injector (decode_service/rank_kv.py,
started by name as the engine's rank service); rank 0 picks the pod's ticket
secret and generation, sends each worker its receiver config and waits for
every rank's READY before it serves (decode_service/rank_links.py). Rank r
listens on --kv-port + r (any free port when --kv-port is 0).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import replace
from pathlib import Path

from decode_service.config import ColocatedConfig, DecodeConfig
from decode_service.injector import KVInjector
from decode_service.kv_import import RemoteKV
from decode_service.rank_kv import RANK_SERVICE
from decode_service.rank_links import DecodeRanks
from decode_service.receiver_metrics import ReceiverCollector
from decode_service.receivers import open_receiver, receiver_config
from decode_service.servicer import DecodeServicer
from decode_service.transfer_eta import TransferETA
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, LoopState
from engine.join_hold import JoinHold
from engine.llm_engine import LLMEngine
from engine.metrics import PodMetrics, serve_metrics
from engine.model_config import ModelConfig
from kv_transfer.base import KVReceiver, RankTarget
from kv_transfer.tickets import new_generation
from pod.cache_events import add_cache_events
from pod.config import ServerConfig
from pod.drain import DrainGate
from pod.kv_shape import kv_shape_of
from pod.messages import ModelLimits
from pod.server import PodServer
from proto import pdserve_pb2_grpc
from proto.address import split_host_port
from proto.roles import PodRole

log = logging.getLogger(__name__)


def _open_remote(decode: DecodeConfig, engine: LLMEngine, loop: EngineLoop,
                 metrics: PodMetrics, eta: TransferETA) -> tuple[KVReceiver, RemoteKV]:
    """Rank 0's receiver and injector, and at TP > 1 the worker ranks' (their
    READY awaited: blocking, so run it off the event loop)."""
    engine_config = decode.engine
    size = engine_config.tensor_parallel_size
    secret = secrets.token_bytes(32) if size > 1 else None  # one ticket for every rank
    generation = new_generation() if size > 1 else None
    injector = KVInjector(loop.kv_caches(), metrics,
                          kernel_backend=engine_config.kernel_backend, eta=eta)
    receiver = open_receiver(decode.kv_transport,
                             receiver_config(decode, 0, secret=secret, generation=generation),
                             injector)
    receiver.start()
    ranks = None
    if size > 1:
        shard = engine.model.shard
        ranks = DecodeRanks(engine.tp, RankTarget(receiver.endpoints, shard.kv_head_start,
                                                  shard.kv_head_end))
        try:
            ranks.start(decode.kv_transport,
                        [receiver_config(decode, r, secret=secret, generation=generation)
                         for r in range(1, size)], engine_config.tp_timeout_s)
        except BaseException:
            receiver.close()
            injector.close()
            raise
    remote = RemoteKV(receiver, injector, kv_shape_of(engine_config.model_dir,
                                                      engine_config.dtype),
                      decode.transfer_timeout_s, decode.reservation_timeout_s, ranks=ranks,
                      forget_timeout_s=engine_config.tp_timeout_s)
    return receiver, remote


async def _serve(role: PodRole, engine_config: EngineConfig, server_config: ServerConfig,
                 stop: asyncio.Event | None, decode: DecodeConfig | None) -> int:
    metrics = PodMetrics.create(role)
    if decode is not None and engine_config.tensor_parallel_size > 1:
        engine_config = replace(engine_config, rank_service=RANK_SERVICE)
    engine = LLMEngine(engine_config)
    eta = TransferETA()  # when a decode pod's transfers end: its join hold asks
    join_hold = None if decode is None else JoinHold(eta.next_ready, decode.join_wait, metrics)
    loop = EngineLoop(engine, metrics, step_hook=join_hold)
    model_config = ModelConfig.from_pretrained(engine_config.model_dir)
    model_name = Path(engine_config.model_dir).name
    on_stopped = [loop.stop]
    extra_ports: dict[str, int] = {}
    remote = None
    if decode is not None:
        try:
            receiver, remote = await asyncio.to_thread(_open_remote, decode, engine, loop,
                                                       metrics, eta)
        except BaseException:
            engine.close()
            raise
        extra_ports["kv"] = split_host_port(receiver.endpoints[0], "KV endpoint")[1]
        metrics.kv_landing_bytes_in_use.set_function(lambda: receiver.stats().bytes_in_use)
        ReceiverCollector(receiver, role).register(metrics.registry)
        on_stopped = [receiver.close, remote.injector.close, loop.stop]
    gate = DrainGate()
    generation = secrets.randbits(63)
    server = PodServer.new_grpc_server(server_config.security)
    cache_events = add_cache_events(server, role=role, generation=generation, engine_loop=loop,
                                    redis_url=server_config.redis_url)
    servicer = DecodeServicer(
        role=role, loop=loop, metrics=metrics, gate=gate,
        limits=ModelLimits(model_config.vocab_size, loop.max_model_len),
        model=model_name, generation=generation, remote=remote,
        cache_events_channel=cache_events.channel,
    )
    pdserve_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    pod = PodServer(
        role=role, model=model_name, config=server_config, gate=gate, server=server,
        services=("pdserve.v1.Decode",), extra_ports=extra_ports, on_stopped=on_stopped,
        metrics_start=lambda host, port: serve_metrics(metrics, host, port),
        alive=lambda: loop.state is LoopState.RUNNING, cache_events=cache_events,
    )
    loop.start()
    await cache_events.attach(loop)
    return await pod.run(stop)


async def run_decode_pod(config: DecodeConfig, stop: asyncio.Event | None = None) -> int:
    """Serve a decode pod until SIGTERM/SIGINT or `stop`; returns the exit status."""
    return await _serve(PodRole.DECODE, config.engine, config.server, stop, config)


async def run_colocated_pod(config: ColocatedConfig, stop: asyncio.Event | None = None) -> int:
    """Serve a colocated pod until SIGTERM/SIGINT or `stop`; returns the exit status."""
    return await _serve(PodRole.COLOCATED, config.engine, config.server, stop, None)

"""Assembles and runs a prefill pod: engine + engine loop + KV senders +
`PrefillServicer` + health + metrics, until SIGTERM.

Called by `pdserve prefill` (pdserve/commands/prefill.py) with a validated
`PrefillConfig`; everything runs in the calling thread's asyncio loop except
the engine loop thread and the senders' I/O threads.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from pathlib import Path

from engine.engine_loop import EngineLoop, LoopState
from engine.llm_engine import LLMEngine
from engine.metrics import PodMetrics, serve_metrics
from engine.model_config import ModelConfig
from kv_transfer.base import KVSender
from kv_transfer.config import SenderConfig
from kv_transfer.tcp import TcpKVSender
from pod.cache_events import add_cache_events
from pod.drain import DrainGate
from pod.kv_shape import kv_shape_of
from pod.messages import ModelLimits
from pod.server import PodServer
from prefill_service.config import PrefillConfig
from prefill_service.kv_export import KVExport
from prefill_service.servicer import PrefillServicer
from proto import pdserve_pb2_grpc
from proto.roles import PodRole
from proto.tls import PodSecurity

log = logging.getLogger(__name__)


def make_senders(kv_streams: int, security: PodSecurity | None = None) -> dict[str, KVSender]:
    """One sender per transport this build has; the target picks per request.
    `security` secures the gRPC transport's channels (the TCP one is
    cluster-internal, docs/deploy.md, Security)."""
    config = SenderConfig(num_streams=kv_streams, security=security or PodSecurity())
    senders: dict[str, KVSender] = {"tcp": TcpKVSender(config)}
    try:
        from kv_transfer.grpc import GrpcKVSender
    except ImportError:  # the gRPC connector is optional
        log.info("gRPC KV sender not available; serving tcp targets only")
    else:
        senders["grpc"] = GrpcKVSender(config)
    return senders


async def run_prefill_pod(config: PrefillConfig, stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT or `stop`; returns the exit status."""
    metrics = PodMetrics.create(PodRole.PREFILL)
    export = KVExport(make_senders(config.kv_streams, config.server.security),
                      kernel_backend=config.engine.kernel_backend)
    engine = LLMEngine(config.engine, layer_kv_hook=export)
    loop = EngineLoop(engine, metrics)
    model_config = ModelConfig.from_pretrained(config.engine.model_dir)
    gate = DrainGate()
    model_name = Path(config.engine.model_dir).name
    generation = secrets.randbits(63)
    server = PodServer.new_grpc_server(config.server.security)
    cache_events = add_cache_events(server, role=PodRole.PREFILL, generation=generation,
                                    engine_loop=loop, redis_url=config.server.redis_url)
    servicer = PrefillServicer(
        loop=loop, export=export, metrics=metrics, gate=gate,
        limits=ModelLimits(model_config.vocab_size, loop.max_model_len),
        kv_shape=kv_shape_of(config.engine.model_dir, config.engine.dtype),
        model=model_name, generation=generation, cache_events_channel=cache_events.channel,
    )
    pdserve_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    pod = PodServer(
        role=PodRole.PREFILL, model=model_name, config=config.server, gate=gate, server=server,
        services=("pdserve.v1.Prefill",),
        on_stopped=[loop.stop, export.close],
        metrics_start=lambda host, port: serve_metrics(metrics, host, port),
        alive=lambda: loop.state is LoopState.RUNNING, cache_events=cache_events,
    )
    loop.start()
    await cache_events.attach(loop)
    return await pod.run(stop)

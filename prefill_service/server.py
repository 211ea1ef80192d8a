"""Assembles and runs a prefill pod: engine + engine loop + KV senders +
`PrefillServicer` + health + metrics, until SIGTERM.

Called by `pdserve prefill` (pdserve/commands/prefill.py) with a validated
`PrefillConfig`; everything runs in the calling thread's asyncio loop except
the engine loop thread and the senders' I/O threads. At
`tensor_parallel_size` N > 1 the engine's worker ranks run the prefill rank
service (prefill_service/rank_export.py), each sending its own KV heads;
rank 0's `KVExport` drives them (`WorkerExports`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import replace
from pathlib import Path

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, LoopState
from engine.llm_engine import LLMEngine
from engine.metrics import PodMetrics, serve_metrics
from engine.model_config import ModelConfig
from pod.cache_events import add_cache_events
from pod.drain import DrainGate
from pod.kv_shape import kv_shape_of
from pod.messages import ModelLimits
from pod.server import PodServer
from prefill_service.config import PrefillConfig
from prefill_service.kv_export import KVExport
from prefill_service.rank_export import RANK_SERVICE
from prefill_service.senders import make_senders
from prefill_service.servicer import PrefillServicer
from prefill_service.worker_exports import WorkerExports
from proto import pdserve_pb2_grpc
from proto.roles import PodRole

log = logging.getLogger(__name__)


def engine_config_of(config: PrefillConfig) -> EngineConfig:
    """The engine's config: at TP > 1 each worker rank runs the prefill rank
    service (its own heads' KV transfers, prefill_service/rank_export.py)."""
    engine = config.engine
    if engine.tensor_parallel_size == 1:
        return engine
    if engine.rank_service not in ("", RANK_SERVICE):
        raise ValueError(f"a prefill pod's workers run {RANK_SERVICE}, not "
                         f"{engine.rank_service!r}")
    return replace(engine, rank_service=RANK_SERVICE)


async def run_prefill_pod(config: PrefillConfig, stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT or `stop`; returns the exit status."""
    metrics = PodMetrics.create(PodRole.PREFILL)
    streams, security = config.kv_streams, config.server.security
    tp = config.engine.tensor_parallel_size
    export = KVExport(make_senders(streams, security),
                      more_senders=lambda: make_senders(streams, security),
                      kernel_backend=config.engine.kernel_backend, prefill_tp=tp)
    engine = LLMEngine(engine_config_of(config), layer_kv_hook=export)
    if tp > 1:
        export.attach_workers(WorkerExports(engine.tp, num_streams=streams, security=security))
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

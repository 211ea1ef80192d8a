"""`load_report`: every pod's `GetLoad` answer, built from its engine loop's
live stats and its drain gate. The prefill and decode servicers' `GetLoad`
is this one call; the router polls it (DESIGN.md "Routing")."""

from __future__ import annotations

from engine.engine_loop import EngineLoop
from pod.drain import DrainGate
from proto import pdserve_pb2


def load_report(role: str, model: str, generation: int, loop: EngineLoop,
                gate: DrainGate, cache_events_channel: str = "") -> pdserve_pb2.LoadReport:
    """A snapshot of `loop.stats` plus who this pod is; called on the pod's event loop.
    `cache_events_channel`: the Redis channel of pod/cache_events.py ("" = none)."""
    stats = loop.stats
    return pdserve_pb2.LoadReport(
        role=role,
        generation=generation,
        num_waiting=stats.num_waiting,
        num_waiting_tokens=stats.num_waiting_tokens,
        num_running=stats.num_running,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        block_size=loop.block_size,
        prefix_hit_rate=(stats.prefix_cache_hits / stats.prefix_cache_queries
                         if stats.prefix_cache_queries else 0.0),
        model=model,
        max_model_len=loop.max_model_len,
        draining=gate.draining,
        cache_events_channel=cache_events_channel,
        device=loop.device_type,
        tensor_parallel_size=loop.tensor_parallel_size,
    )

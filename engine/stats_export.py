"""`StatsExport`: an engine's `EngineStats` into its pod's metrics.

Who uses it: the engine loop (engine/engine_loop.py) after every step and
command, and the simulated pods' loop (sim/engine_loop.py), which runs the
same scheduler and block manager, so both export the same gauges from the
same sums. Gauges are set; the engine's cumulative totals (prefix-cache
queries and hits, requests that waited for a prefix in flight, ITL-budget
capped steps) go into counters as deltas, so
this object remembers what it has counted already.
"""

from __future__ import annotations

from engine.metrics import PodMetrics
from engine.outputs import EngineStats


class StatsExport:
    """What one engine's counters have been given so far (module docstring)."""

    def __init__(self, metrics: PodMetrics) -> None:
        self._metrics = metrics
        self._counted_queries = 0
        self._counted_hits = 0
        self._counted_capped = 0
        self._counted_waits = 0

    def publish(self, engine, stats: EngineStats) -> None:
        """Export `stats` (just taken from `engine`); `engine` gives the token
        gauges their queues (engine/token_gauges.py) and its scheduler's ITL
        budget, when it has one, its step model."""
        m = self._metrics
        m.requests_waiting.set(stats.num_waiting)
        m.requests_running.set(stats.num_running)
        m.requests_reserved.set(stats.num_reserved)
        m.kv_blocks_reserved.set(stats.num_reserved_blocks)
        m.kv_blocks_free.set(stats.num_free_blocks)
        m.kv_blocks_total.set(stats.num_total_blocks)
        m.publish_tokens(engine, stats)
        m.prefix_cache_queries.inc(max(0, stats.prefix_cache_queries - self._counted_queries))
        m.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - self._counted_hits))
        self._counted_queries = stats.prefix_cache_queries
        self._counted_hits = stats.prefix_cache_hits
        waits = engine.scheduler.prefix_wait.num_waits
        m.prefix_waits.inc(max(0, waits - self._counted_waits))
        self._counted_waits = waits
        budget = getattr(engine.scheduler, "itl_budget", None)
        if budget is not None:
            m.step_model(budget.snapshot())
            m.itl_budget_capped_steps.inc(max(0, budget.capped_steps - self._counted_capped))
            self._counted_capped = budget.capped_steps

"""P:D sizing: how many prefill and decode pods a measured workload needs
(issue 39), in the simplest mode of Dynamo's planner: each side is its token
rate over one pod's measured capacity, with headroom, rounded up.

Who uses it: `pdserve plan` (pdserve/commands/plan.py) builds a `Workload`
from flags or a `pdserve bench serve` result, a `PodCapacity` from flags or
a router's /metrics, and prints `explain(size(...))`. The arithmetic is kept
here, apart from argparse, so tests check it directly.

Why this is enough for a first answer: a prefill pod's work is the prompt
tokens it computes (less what the prefix cache saves) and a decode pod's
is the output tokens it generates at its batch size; both scale about
linearly with pods. It ignores the P/D paths that move prefill onto decode
pods (local and split prefill) and the KV transfer's cost; measure again
after scaling.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

DEFAULT_HEADROOM = 0.2

_RATE_SAMPLE = re.compile(
    r"^pdserve_router_queue_prefill_tokens_per_second(?:\{[^}]*\})?\s+(\S+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Workload:
    """Token rates to serve, and the share of prompt tokens the prefix cache
    saves (0 <= ratio < 1)."""

    prompt_tokens_per_s: float
    output_tokens_per_s: float
    prefix_hit_ratio: float = 0.0

    def __post_init__(self) -> None:
        _at_least("prompt-tokens-per-s", self.prompt_tokens_per_s, 0.0)
        _at_least("output-tokens-per-s", self.output_tokens_per_s, 0.0)
        if not 0.0 <= self.prefix_hit_ratio < 1.0:
            raise ValueError(f"prefix-hit-ratio must be in [0, 1), got {self.prefix_hit_ratio}")


@dataclass(frozen=True, slots=True)
class PodCapacity:
    """One pod's measured rates: prompt tokens a prefill pod computes per
    second, output tokens a decode pod generates per second at its batch."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float

    def __post_init__(self) -> None:
        for name, value in (("prefill-tokens-per-s", self.prefill_tokens_per_s),
                            ("decode-tokens-per-s", self.decode_tokens_per_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0 (one pod's measured rate), got {value}")


@dataclass(frozen=True, slots=True)
class Sizing:
    """The answer and the numbers it came from."""

    workload: Workload
    capacity: PodCapacity
    headroom: float
    prefill_demand: float  # prompt tokens/s to compute, headroom included
    decode_demand: float  # output tokens/s to generate, headroom included
    prefill_pods: int
    decode_pods: int

    @property
    def exact_ratio(self) -> float:
        """Prefill pods per decode pod before rounding."""
        return ((self.prefill_demand / self.capacity.prefill_tokens_per_s)
                / (self.decode_demand / self.capacity.decode_tokens_per_s)
                if self.decode_demand > 0 else math.inf)


def _at_least(name: str, value: float, low: float) -> None:
    if not (math.isfinite(value) and value >= low):
        raise ValueError(f"{name} must be a number >= {low:g}, got {value}")


def _pods(demand: float, per_pod: float) -> int:
    # at least one of each: a P/D deployment needs both sides to serve at all
    return max(1, math.ceil(demand / per_pod - 1e-9))


def size(workload: Workload, capacity: PodCapacity, headroom: float = DEFAULT_HEADROOM
         ) -> Sizing:
    """Pods of each role so that none runs above 1 / (1 + headroom) of its
    measured capacity."""
    _at_least("headroom", headroom, 0.0)
    prefill = workload.prompt_tokens_per_s * (1.0 - workload.prefix_hit_ratio) * (1 + headroom)
    decode = workload.output_tokens_per_s * (1 + headroom)
    return Sizing(workload, capacity, headroom, prefill, decode,
                  _pods(prefill, capacity.prefill_tokens_per_s),
                  _pods(decode, capacity.decode_tokens_per_s))


def explain(s: Sizing) -> str:
    """The arithmetic, line by line, then the answer."""
    w, c, h = s.workload, s.capacity, s.headroom
    ratio = "n/a (no output tokens)" if math.isinf(s.exact_ratio) else f"{s.exact_ratio:.2f}"
    return "\n".join([
        f"prefill: {w.prompt_tokens_per_s:,.0f} prompt tok/s x (1 - {w.prefix_hit_ratio:g} "
        f"cached) x (1 + {h:g} headroom) = {s.prefill_demand:,.0f} tok/s to compute",
        f"         / {c.prefill_tokens_per_s:,.0f} tok/s per prefill pod = "
        f"{s.prefill_demand / c.prefill_tokens_per_s:.2f} -> {s.prefill_pods} prefill pod(s)",
        f"decode:  {w.output_tokens_per_s:,.0f} output tok/s x (1 + {h:g} headroom) = "
        f"{s.decode_demand:,.0f} tok/s to generate",
        f"         / {c.decode_tokens_per_s:,.0f} tok/s per decode pod = "
        f"{s.decode_demand / c.decode_tokens_per_s:.2f} -> {s.decode_pods} decode pod(s)",
        f"P:D = {s.prefill_pods}:{s.decode_pods} (exact prefill pods per decode pod: {ratio})",
    ])


def workload_from_bench(result: dict) -> Workload:
    """A `pdserve bench serve` result's measured rates (input and output
    tokens per second) and its pods' prefix-cache hit rate."""
    missing = [k for k in ("input_throughput", "output_throughput") if k not in result]
    if missing:
        raise ValueError(f"not a `pdserve bench serve` result: no {', '.join(missing)}")
    hit = (result.get("server_metrics") or {}).get("prefix_cache_hit_rate") or 0.0
    return Workload(float(result["input_throughput"]), float(result["output_throughput"]),
                    min(float(hit), 0.99))


def prefill_rate_from_router(metrics_text: str) -> float:
    """Mean prefill tokens/s per pod a router has learnt
    (pdserve_router_queue_prefill_tokens_per_second over its prefill pods;
    pods not measured yet read NaN and are left out)."""
    rates = [float(v) for v in _RATE_SAMPLE.findall(metrics_text)]
    known = [r for r in rates if math.isfinite(r) and r > 0]
    if not known:
        raise ValueError("the router has not measured a prefill pod's rate yet "
                         "(pdserve_router_queue_prefill_tokens_per_second is NaN or absent): "
                         "serve some prompts first or pass --prefill-tokens-per-s")
    return sum(known) / len(known)

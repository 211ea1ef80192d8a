"""Goodput and the console table of a `pdserve bench serve` run.

Goodput counts the requests that completed and met every SLO given:
`--slo-ttft MS` on the time to first token, `--slo-itl MS` on every one of
the request's inter-token latencies (its worst gap, so one stall fails the
request, which is what a reader of a streamed answer notices). With no SLO
given, every completed request counts.
"""

from __future__ import annotations

import sys
from typing import TextIO


def goodput(requests: list[dict], duration_s: float, slo_ttft_ms: float | None,
            slo_itl_ms: float | None) -> dict:
    """{slo_ttft_ms, slo_itl_ms, requests, request_rate, fraction} over the
    request records (benchmarks/serve_client.py's RequestRecord as dicts)."""
    for name, value in (("--slo-ttft", slo_ttft_ms), ("--slo-itl", slo_itl_ms)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 ms, got {value}")
    good = 0
    for r in requests:
        if r["error"] is not None:
            continue
        if slo_ttft_ms is not None and r["ttft_s"] * 1e3 > slo_ttft_ms:
            continue
        if slo_itl_ms is not None and r["itl_s"] and max(r["itl_s"]) * 1e3 > slo_itl_ms:
            continue
        good += 1
    return {"slo_ttft_ms": slo_ttft_ms, "slo_itl_ms": slo_itl_ms, "requests": good,
            "request_rate": good / duration_s if duration_s > 0 else 0.0,
            "fraction": good / len(requests) if requests else 0.0}


def _ms(stats: dict, key: str) -> str:
    value = stats[key]
    return "—" if value is None else f"{value:,.1f}"


def print_summary(result: dict, out: TextIO | None = None) -> None:
    """A short human-readable table of one run (the JSON holds everything)."""
    out = sys.stdout if out is None else out
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"\n{result['label']}: {result['completed']}/{result['num_requests']} requests in "
      f"{result['duration_s']:.1f} s, {result['errors']} errors")
    p(f"  throughput: {result['request_throughput']:.3f} req/s, output "
      f"{result['output_throughput']:.1f} tok/s, input {result['input_throughput']:.1f} tok/s")
    g = result["goodput"]
    slos = [f"{name} <= {g[key]:g} ms" for name, key in (("TTFT", "slo_ttft_ms"),
                                                         ("every ITL", "slo_itl_ms"))
            if g[key] is not None]
    p(f"  goodput ({', '.join(slos) or 'no SLO given'}): {g['requests']} requests, "
      f"{g['request_rate']:.3f} req/s ({g['fraction']:.0%})")
    p("  | ms | mean | p50 | p90 | p99 |")
    p("  |---|---:|---:|---:|---:|")
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = result[f"{name}_ms"]
        p(f"  | {name.upper()} | " + " | ".join(_ms(stats, k) for k in
                                                ("mean", "p50", "p90", "p99")) + " |")
    m = result["server_metrics"]
    if m["note"]:
        p(f"  pod metrics: {m['note']}")
    else:
        rate = m["prefix_cache_hit_rate"]
        p(f"  pod metrics: prefix cache hit rate "
          f"{'—' if rate is None else f'{rate:.1%}'} ({m['prefix_cache_hits']:.0f}/"
          f"{m['prefix_cache_queries']:.0f} blocks), KV sent {m['kv_bytes_sent']:,.0f} B, "
          f"received {m['kv_bytes_received']:,.0f} B")
    for message in result["error_messages"]:
        p(f"  error: {message}")

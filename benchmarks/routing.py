"""`pdserve bench routing`: the prefill routing policies on the Mooncake trace.

    stacks      `pdserve up --prefill N --decode D` for each N of
                --prefill-counts (2 and 4) and each --routing-policy of
                --policies: round-robin, session-sticky, first-tokens (the
                router's default), cache-aware, and cache-aware+miss-only
                (cache-aware with the decode pod's prefix cache on: it holds
                a prompt's leading blocks and is sent only the rest; the
                decode pods' default since 2026-11-29, so a policy without
                the suffix runs them with --no-prefix-cache, as its name
                always meant); every run on fresh pods, so no run warms
                another's caches
    workload    --trace-requests lines of the trace from line --trace-start
                (default: its last 500, where prefixes are shared most: the
                oracle below is 0.69 there, 0.09 over its first 500), scaled
                (benchmarks/serve_trace.py: lengths and block size x
                --trace-length-scale, 512-token blocks becoming the prefill
                pods' 16 by default; outputs x --trace-output-scale; arrival
                times x --trace-time-scale); the session-sticky run sends the
                trace's conversations as session ids, the others none
                (benchmarks/routing_trace.py)
    per run     benchmarks/serve.py's run_benchmark with the pods' counters;
                a JSON per run in --out-dir
    figures     hit ratio = prompt tokens the prefill pods took from their
                prefix caches (each response's usage.cached_tokens) / prompt
                tokens, beside the trace's oracle (one unbounded cache
                shared by all pods) and the part of it the engine can reach
                (full prompt blocks only, never the last token's); p90 TTFT
                and round-robin's p90 / it;
                KV bytes the prefill pods sent / the bytes of every prompt's
                full context (layers x 2 x kv heads x head dim x dtype size
                per token); the decode side's hit fraction, measured on its
                own: the bytes the decode pods held (their
                pdserve_kv_transfer_saved_bytes_total) / held + received

Runs one stack at a time: measure on an otherwise quiet machine. The issue's
targets (cache-aware with 4 prefill pods: hit ratio >= 0.9x the oracle, p90
TTFT >= 3x better than round-robin) are printed beside the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import disagg, peer_servers
from benchmarks.routing_trace import (
    conversation_ids,
    oracle_hit_ratio,
    reachable_hit_ratio,
    with_sessions,
)
from benchmarks.serve_trace import TraceScaling, load_trace, trace_sessions
from benchmarks.serve_workload import Vocabulary
from router.routing.cache_aware import check_load_weight

HELP = ("Prefill routing policies (round-robin, session-sticky, first-tokens, cache-aware, "
        "cache-aware+miss-only) on "
        "the Mooncake trace with 2 and 4 prefill pods: prefix hit ratio vs the trace's oracle, "
        "p90 TTFT, KV bytes sent vs full context.")
POLICIES = ("round-robin", "session-sticky", "first-tokens", "cache-aware",
            "cache-aware+miss-only")
MISS_ONLY = "+miss-only"  # the policy, and the decode pods' prefix cache on
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base",
                        help="model dir, .gguf file or name: smollm2-135m-instruct, tiny, base")
    parser.add_argument("--prefill-counts", default="2,4", metavar="N,...",
                        help="prefill pods per stack (default 2,4)")
    parser.add_argument("--decode", type=int, default=1, help="decode pods per stack")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, of {', '.join(POLICIES)}; a cache-aware one "
                             "may end in @W to run it with --cache-aware-load-weight W, e.g. "
                             "cache-aware@0.25")
    parser.add_argument("--trace", default=str(disagg.DEFAULT_TRACE), metavar="PATH")
    parser.add_argument("--trace-start", type=int, default=3493, metavar="LINE",
                        help="the first trace line replayed, from 0 (default 3493: the last "
                             "500 lines of the synthetic trace)")
    parser.add_argument("--trace-requests", type=int, default=500,
                        help="lines replayed (sharing grows along the trace: the oracle is "
                             "0.09 over its first 500 lines, 0.69 over its last 500)")
    parser.add_argument("--trace-length-scale", type=float, default=1 / 32,
                        help="prompt lengths and block size times this (default 1/32)")
    parser.add_argument("--trace-output-scale", type=float, default=1 / 32)
    parser.add_argument("--trace-time-scale", type=float, default=1.0,
                        help="arrival times times this (> 1 spreads requests out)")
    parser.add_argument("--kv-dtype", choices=tuple(DTYPE_BYTES), default=None,
                        help="the pods' KV dtype, for the full-context bytes (default: as "
                             "the pods resolve --dtype auto: float32 on CPU, else the "
                             "checkpoint's)")
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="MS")
    parser.add_argument("--slo-itl", type=float, default=None, metavar="MS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pod-arg", action="append", default=["--kv-cache-memory=2GiB"],
                        metavar="ARG", help="extra flag for every pod")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for the router")
    parser.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for pdserve up, e.g. --up-arg=--prefill-cpus=0-3")
    parser.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument("--out-dir", default=None, metavar="DIR",
                        help="results and comparison.json (default: a new temporary dir)")
    parser.add_argument("--no-progress", action="store_true")


def _list(text: str, flag: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise ValueError(f"{flag} needs at least one entry")
    return items


def parse_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in _list(text, "--prefill-counts"))
    except ValueError as exc:
        raise ValueError(f"--prefill-counts: {exc}") from None
    if any(not 1 <= n <= 64 for n in counts):
        raise ValueError(f"--prefill-counts must be in [1, 64], got {text!r}")
    return counts


def parse_policies(text: str) -> tuple[str, ...]:
    """Names of POLICIES, any of them ending in +miss-only (the decode pods'
    prefix cache on); a cache-aware one may end in @W, its load weight
    (the router's --cache-aware-load-weight W), e.g. cache-aware@0.25."""
    policies = _list(text, "--policies")
    for name in policies:
        base, _, weight = name.partition("@")
        if base.removesuffix(MISS_ONLY) not in POLICIES or (
                weight and not base.startswith("cache-aware")):
            raise ValueError(f"--policies: {name!r} is not one of {', '.join(POLICIES)} "
                             f"(any may end in {MISS_ONLY}; cache-aware ones in @WEIGHT)")
        if weight:
            try:
                check_load_weight(float(weight))
            except ValueError as exc:
                raise ValueError(f"--policies: {name!r}: {exc}") from None
    return policies


def kv_bytes_per_token(model_dir: Path, kv_dtype: str | None, pod_args: list[str]) -> int:
    """Bytes of one token's KV over all layers as the pods store it."""
    from pdserve.commands._pod_flags import resolve_device, resolve_dtype
    from pod.kv_shape import kv_shape_of

    dtype = kv_dtype
    if dtype is None:
        flag = next((a.split("=", 1)[1] for a in pod_args if a.startswith("--dtype=")), "auto")
        dtype = resolve_dtype(flag, resolve_device("auto"), str(model_dir))
    shape = kv_shape_of(str(model_dir), dtype)
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[dtype]


def figures(result: dict, oracle: float, bytes_per_token: int,
            reachable: float | None = None) -> dict:
    """One run's hit ratio, p90 TTFT and KV bytes (module docstring)."""
    ok = [r for r in result["requests"] if r["error"] is None]
    prompt_tokens = sum(r["prompt_len"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    hit = cached / prompt_tokens if prompt_tokens else None
    metrics = result["server_metrics"]
    sent = metrics["kv_bytes_sent"]
    full = prompt_tokens * bytes_per_token
    held, received = metrics.get("kv_bytes_saved"), metrics.get("kv_bytes_received")
    decode_hit = (held / (held + received) if held is not None and received is not None
                  and held + received else None)
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached, "hit_ratio": hit,
            "oracle_hit_ratio": oracle, "reachable_hit_ratio": reachable,
            "hit_vs_oracle": hit / oracle if hit is not None and oracle else None,
            "ttft_p90_ms": result["ttft_ms"]["p90"], "ttft_p50_ms": result["ttft_ms"]["p50"],
            "kv_bytes_sent": sent, "kv_bytes_full_context": full,
            "kv_sent_vs_full": sent / full if sent is not None and full else None,
            "decode_kv_hit_fraction": decode_hit,
            "kv_saved_vs_full": 1 - sent / full if sent is not None and full else None,
            "errors": result["errors"]}


def add_ttft_gains(rows: dict[int, dict[str, dict]]) -> None:
    """round-robin's p90 TTFT / each policy's, per prefill count (where both ran)."""
    for per_policy in rows.values():
        base = per_policy.get("round-robin", {}).get("ttft_p90_ms")
        for row in per_policy.values():
            p90 = row["ttft_p90_ms"]
            row["ttft_p90_gain_vs_round_robin"] = base / p90 if base and p90 else None


def print_table(rows: dict[int, dict[str, dict]]) -> None:
    def cell(value: float | None, fmt: str, unit: str = "") -> str:
        return "—" if value is None else format(value, fmt) + unit

    print("\n| prefill pods | policy | hit ratio | oracle | vs oracle | reachable | "
          "p90 TTFT ms | RR p90 / p90 | KV sent / full | decode hit fraction |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for count, per_policy in rows.items():
        for policy, r in per_policy.items():
            print(f"| {count} | {policy} | {cell(r['hit_ratio'], '.3f')} | "
                  f"{r['oracle_hit_ratio']:.3f} | {cell(r['hit_vs_oracle'], '.2f', 'x')} | "
                  f"{cell(r['reachable_hit_ratio'], '.3f')} | "
                  f"{cell(r['ttft_p90_ms'], ',.0f')} | "
                  f"{cell(r['ttft_p90_gain_vs_round_robin'], '.2f', 'x')} | "
                  f"{cell(r['kv_sent_vs_full'], '.2f')} | "
                  f"{cell(r.get('decode_kv_hit_fraction'), '.2f')} |")
    print("\ntargets (issue 12): cache-aware, 4 prefill pods: vs oracle >= 0.9x, "
          "RR p90 / p90 >= 3x; cache-miss-only transfer: 1 - KV sent / full >= the "
          "decode hit fraction")


def main(args: argparse.Namespace) -> int:
    try:
        counts = parse_counts(args.prefill_counts)
        policies = parse_policies(args.policies)
        if args.decode < 1 or args.trace_requests < 1 or args.trace_start < 0:
            raise ValueError("--decode and --trace-requests must be >= 1, --trace-start >= 0")
        model_dir = peer_servers.model_dir(args.model)
        scaling = TraceScaling(512, args.trace_length_scale, args.trace_output_scale,
                               args.trace_time_scale)
        requests = load_trace(Path(args.trace), args.trace_start + args.trace_requests)
        requests = requests[args.trace_start:]
        if not requests:
            raise ValueError(f"--trace-start {args.trace_start}: the trace has fewer lines")
        sessions = trace_sessions(requests, scaling, Vocabulary.from_model_dir(model_dir),
                                  args.seed)
        conversations = with_sessions(sessions, conversation_ids(requests))
        oracle = oracle_hit_ratio(requests, scaling)
        reachable = reachable_hit_ratio(requests, scaling)
        bytes_per_token = kv_bytes_per_token(model_dir, args.kv_dtype, args.pod_arg)
    except ValueError as exc:
        print(f"pdserve bench routing: error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="pdserve-bench-routing-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    description = {"kind": "trace", "trace": args.trace, "start": args.trace_start,
                   "max_requests": args.trace_requests,
                   "block_size": 512, "length_scale": args.trace_length_scale,
                   "output_scale": args.trace_output_scale,
                   "time_scale": args.trace_time_scale}
    started = time.time()
    rows: dict[int, dict[str, dict]] = {}
    for count in counts:
        rows[count] = {}
        for policy in policies:
            workload = disagg.Workload(
                "trace", conversations if policy == "session-sticky" else sessions, None,
                {**description, "sessions": policy == "session-sticky"})
            name = f"prefill{count}-{policy}"
            variant, _, weight = policy.partition("@")
            up_args = ["--prefill", str(count), "--decode", str(args.decode),
                       f"--router-arg=--routing-policy={variant.removesuffix(MISS_ONLY)}",
                       *args.up_arg]
            up_args.append("--decode-arg=--prefix-cache" if variant.endswith(MISS_ONLY)
                           else "--decode-arg=--no-prefix-cache")
            if weight:
                up_args.append(f"--router-arg=--cache-aware-load-weight={weight}")
            try:
                (result,) = disagg.run_topology(name, up_args, model_dir, [workload], args,
                                                out_dir).values()
            except RuntimeError as exc:
                print(f"pdserve bench routing: error: {exc}", file=sys.stderr)
                return 1
            rows[count][policy] = figures(result, oracle, bytes_per_token, reachable)
    add_ttft_gains(rows)
    print_table(rows)
    (out_dir / "comparison.json").write_text(json.dumps(
        {"model": str(model_dir), "started_unix": started, "wall_s": time.time() - started,
         "workload": description, "oracle_hit_ratio": oracle,
         "reachable_hit_ratio": reachable,
         "kv_bytes_per_token": bytes_per_token,
         "rows": {str(c): p for c, p in rows.items()},
         "runs": {str(c): {p: f"trace-prefill{c}-{p}.json" for p in per}
                  for c, per in rows.items()}},
        indent=1, allow_nan=False))
    print(f"\nresults and comparison.json in {out_dir}")
    return 1 if any(r["errors"] for per in rows.values() for r in per.values()) else 0

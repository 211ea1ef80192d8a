"""`pdserve plan`: the P:D ratio and pod counts a measured workload needs,
with the arithmetic shown (docs/observability.md, "P:D ratio").

The workload comes from flags or a `pdserve bench serve` result; a prefill
pod's rate from a flag or a router's /metrics; a decode pod's rate from a
flag. The sizing itself is benchmarks/capacity.py's.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

HELP = "Print the prefill:decode pod counts a workload needs from measured token rates."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from benchmarks.capacity import DEFAULT_HEADROOM

    load = parser.add_argument_group("workload (flags, or --bench-result)")
    load.add_argument("--prompt-tokens-per-s", type=float, default=None,
                      help="prompt tokens arriving per second")
    load.add_argument("--output-tokens-per-s", type=float, default=None,
                      help="output tokens to generate per second")
    load.add_argument("--bench-result", default=None, metavar="FILE",
                      help="a `pdserve bench serve` JSON: its input and output tokens/s and "
                           "prefix-cache hit rate")
    load.add_argument("--prefix-hit-ratio", type=float, default=None,
                      help="share of prompt tokens the prefix cache saves, in [0, 1) "
                           "(default: the bench result's, else 0)")
    pods = parser.add_argument_group("one pod's measured capacity")
    pods.add_argument("--prefill-tokens-per-s", type=float, default=None,
                      help="prompt tokens one prefill pod computes per second")
    pods.add_argument("--router-metrics", default=None, metavar="URL",
                      help="a router's /metrics URL: the mean learnt prefill tokens/s of its "
                           "prefill pods, instead of --prefill-tokens-per-s")
    pods.add_argument("--decode-tokens-per-s", type=float, required=True,
                      help="output tokens one decode pod generates per second at its batch")
    parser.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                        help="spare capacity kept on every pod: pods run at most at "
                             "1 / (1 + headroom) of their rate")


def _workload(args: argparse.Namespace):
    from benchmarks.capacity import Workload, workload_from_bench

    flags = (args.prompt_tokens_per_s, args.output_tokens_per_s)
    if args.bench_result is not None:
        if any(f is not None for f in flags):
            raise ValueError("give --bench-result or --prompt/--output-tokens-per-s, not both")
        with open(args.bench_result, encoding="utf-8") as f:
            measured = workload_from_bench(json.load(f))
        hit = measured.prefix_hit_ratio if args.prefix_hit_ratio is None else args.prefix_hit_ratio
        return Workload(measured.prompt_tokens_per_s, measured.output_tokens_per_s, hit)
    if any(f is None for f in flags):
        raise ValueError("the workload needs --prompt-tokens-per-s and --output-tokens-per-s "
                         "(or --bench-result)")
    return Workload(*flags, args.prefix_hit_ratio or 0.0)


def _prefill_rate(args: argparse.Namespace) -> float:
    from benchmarks.capacity import prefill_rate_from_router

    if (args.prefill_tokens_per_s is None) == (args.router_metrics is None):
        raise ValueError("give one of --prefill-tokens-per-s and --router-metrics")
    if args.prefill_tokens_per_s is not None:
        return args.prefill_tokens_per_s
    with urllib.request.urlopen(args.router_metrics, timeout=10) as response:
        return prefill_rate_from_router(response.read().decode())


def main(args: argparse.Namespace) -> int:
    from benchmarks.capacity import PodCapacity, explain, size

    try:
        capacity = PodCapacity(_prefill_rate(args), args.decode_tokens_per_s)
        print(explain(size(_workload(args), capacity, args.headroom)))
    except (ValueError, OSError) as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    return 0

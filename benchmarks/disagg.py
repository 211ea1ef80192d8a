"""`pdserve bench disagg`: the headline comparison. Disaggregated serving
against colocated serving of the same CPUs, on the same requests.

    topologies  disaggregated: `pdserve up` with 1 prefill pod pinned to
                --prefill-cpus and 1 decode pod pinned to --decode-cpus
                (disjoint; one torch thread per CPU);
                disaggregated-shared (not run by default): the same pods
                sharing every CPU (`--pin off`: `pdserve up`'s behaviour
                before --pin auto, and what it does with fewer CPUs than pods);
                colocated: `pdserve up --prefill 0 --decode 0 --colocated 1`,
                its pod pinned to both lists together (so both get the same
                cores);
                colocated-dp (not run by default): two colocated pods, one
                on each list (data parallel: each prompt runs on one pod's
                cores, as on GPU nodes with one pod per GPU, where no
                colocated pod prefills on its neighbour's GPU);
                the router runs unpinned unless --router-cpus
    workloads   heavy-0.2, heavy-0.4  prefill-heavy mix: 384-1,152 prompt
                              tokens (768 +- 50%), 128 out, Poisson 0.2 and
                              0.4 req/s, --num-requests each
                light-c8      256 in / 64 out, concurrency 8, --light-requests
                trace         the first --trace-requests lines of the Mooncake
                              synthetic trace, by default lengths x1/32 (512-token
                              blocks become 16, the prefill pod's block size),
                              outputs x1/4, arrival times x32: about 0.12 req/s
                              of ~480-token prompts on average (--trace-*-scale
                              change them; docs/benchmarks.md says what a short
                              check on 2 cores showed)
    per run     benchmarks/serve.py's run_benchmark (with the pods' counters);
                a JSON per (workload, topology) in --out-dir
    comparison  disaggregated / each colocated topology that ran, per
                workload: TTFT p50, ITL p99, output tok/s, goodput
                (--slo-ttft, default 10 s), beside the issue's targets;
                comparison.json, and plots/<workload>/ with every topology
                on each chart

One topology runs at a time, on otherwise idle cores: run it on a quiet
machine. Each topology is started once and serves every workload in turn
(each workload's prompts are its own, so no workload warms another's cache).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import peer_servers, serve_plot
from benchmarks.serve import ServeRun, run_benchmark
from benchmarks.serve_client import LoadSpec
from benchmarks.serve_metrics import urls_from_up_ready_file
from benchmarks.serve_report import print_summary
from benchmarks.serve_trace import TraceScaling, load_trace, trace_sessions
from benchmarks.serve_workload import RandomWorkload, Session, Vocabulary
from pdserve.commands._cpus import allowed_cpus, format_cpu_list, parse_cpu_list

HELP = ("Disaggregated (1 prefill + 1 decode pod on disjoint CPUs) vs colocated serving on "
        "the same CPUs: prefill-heavy, light and trace workloads; ratios and charts.")
TOPOLOGIES = ("disaggregated", "disaggregated-shared", "colocated", "colocated-dp")
DISAGGREGATED = ("disaggregated", "disaggregated-shared")
DEFAULT_TOPOLOGIES = ("disaggregated", "colocated")
BASELINES = ("colocated", "colocated-dp")
WORKLOADS = ("heavy-0.2", "heavy-0.4", "light-c8", "trace")
DEFAULT_TRACE = peer_servers.REPO_ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"
# (label, how to read it from a result)
METRICS = (
    ("TTFT p50", lambda r: r["ttft_ms"]["p50"]),
    ("ITL p99", lambda r: r["itl_ms"]["p99"]),
    ("output tok/s", lambda r: r["output_throughput"]),
    ("goodput req/s", lambda r: r["goodput"]["request_rate"]),
)
# issue 14's (and for light-c8's ITL, issue 42's) targets for disaggregated /
# colocated, per workload and metric
TARGETS = {
    "heavy": {"TTFT p50": "<= 1.5", "ITL p99": "<= 0.3", "output tok/s": ">= 1.0",
              "goodput req/s": ">= 1.0"},
    "light-c8": {"output tok/s": ">= 1.0", "ITL p99": "<= 1.5"},
    "trace": {},
}


def target(workload: str, metric: str) -> str:
    return TARGETS["heavy" if workload.startswith("heavy-") else workload].get(metric, "")


@dataclass(frozen=True, slots=True)
class Workload:
    """One named workload: its sessions and the in-flight cap."""

    name: str
    sessions: list[Session]
    concurrency: int | None
    description: dict


def build_workloads(names: tuple[str, ...], args: argparse.Namespace,
                    vocab: Vocabulary) -> list[Workload]:
    out = []
    for index, name in enumerate(names):
        seed = args.seed * 100 + index  # each workload its own prompts
        if name.startswith("heavy-"):
            rate = float(name.removeprefix("heavy-"))
            w = RandomWorkload(args.num_requests, 768, 128, range_ratio=0.5,
                               output_range_ratio=0.0, request_rate=rate, seed=seed)
            out.append(Workload(name, w.sessions(vocab), None, {"kind": "random", **asdict(w)}))
        elif name == "light-c8":
            w = RandomWorkload(args.light_requests, 256, 64, seed=seed)
            out.append(Workload(name, w.sessions(vocab), 8, {"kind": "random", **asdict(w),
                                                               "concurrency": 8}))
        else:
            scaling = TraceScaling(512, args.trace_length_scale, args.trace_output_scale,
                                   args.trace_time_scale)
            requests = load_trace(Path(args.trace), args.trace_requests)
            out.append(Workload(name, trace_sessions(requests, scaling, vocab, seed), None,
                                {"kind": "trace", "trace": args.trace,
                                 "max_requests": args.trace_requests, **asdict(scaling)}))
    return out


def topology_args(topology: str, prefill_cpus: tuple[int, ...], decode_cpus: tuple[int, ...],
                  router_cpus: tuple[int, ...] | None) -> list[str]:
    """`pdserve up` flags of one topology (both get the same CPUs in all)."""
    if topology == "disaggregated":
        argv = ["--prefill", "1", "--decode", "1", "--prefill-cpus",
                format_cpu_list(prefill_cpus), "--decode-cpus", format_cpu_list(decode_cpus)]
    elif topology == "disaggregated-shared":
        argv = ["--prefill", "1", "--decode", "1", "--pin", "off"]
    elif topology == "colocated-dp":
        argv = ["--prefill", "0", "--decode", "0", "--colocated", "2", "--colocated-cpus",
                f"{format_cpu_list(prefill_cpus)}/{format_cpu_list(decode_cpus)}"]
    else:
        argv = ["--prefill", "0", "--decode", "0", "--colocated", "1", "--colocated-cpus",
                format_cpu_list(prefill_cpus + decode_cpus)]
    if router_cpus is not None:
        argv += ["--router-cpus", format_cpu_list(router_cpus)]
    return argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base",
                        help="model dir, .gguf file or name: smollm2-135m-instruct, tiny, base")
    cpus = allowed_cpus()
    parser.add_argument("--prefill-cpus", default=str(cpus[0]), metavar="LIST",
                        help=f"the prefill pod's CPUs (default {cpus[0]})")
    parser.add_argument("--decode-cpus", default=str(cpus[min(1, len(cpus) - 1)]),
                        metavar="LIST", help="the decode pod's CPUs (default the next one); "
                        "the colocated pod gets both lists")
    parser.add_argument("--router-cpus", default=None, metavar="LIST",
                        help="the router's CPUs (default: unpinned)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (or heavy-RATE: "
                             "the prefill-heavy mix at any rate in req/s, e.g. heavy-0.8)")
    parser.add_argument("--topologies", default=",".join(DEFAULT_TOPOLOGIES),
                        help=f"comma-separated, run in this order, of {', '.join(TOPOLOGIES)} "
                             f"(default {','.join(DEFAULT_TOPOLOGIES)})")
    parser.add_argument("--num-requests", type=int, default=40,
                        help="requests of each prefill-heavy workload (default 40: with 16, "
                             "colocated's output tok/s at 0.8 req/s spread 16%% over three "
                             "runs, with 40 6%%)")
    parser.add_argument("--light-requests", type=int, default=128,
                        help="requests of light-c8 (default 128: with 32 the run is ~15 s, "
                             "and its first 8 s, where the prefill pod alone takes 8 prompts "
                             "at once, set the ratio)")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), metavar="PATH")
    parser.add_argument("--trace-requests", type=int, default=24,
                        help="the trace's first N lines")
    parser.add_argument("--trace-length-scale", type=float, default=1 / 32,
                        help="trace prompt lengths and block size times this (default 1/32)")
    parser.add_argument("--trace-output-scale", type=float, default=1 / 4)
    parser.add_argument("--trace-time-scale", type=float, default=32.0,
                        help="trace arrival times times this")
    parser.add_argument("--slo-ttft", type=float, default=10000.0, metavar="MS")
    parser.add_argument("--slo-itl", type=float, default=None, metavar="MS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pod-arg", action="append", default=["--kv-cache-memory=2GiB"],
                        metavar="ARG", help="extra flag for every pod")
    parser.add_argument("--prefill-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for the disaggregated topologies' prefill pod, e.g. "
                             "--prefill-arg=--nice=19")
    parser.add_argument("--decode-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for the decode pod of the disaggregated topology, "
                             "e.g. --decode-arg=--max-num-batched-tokens=64")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for the router, e.g. "
                             "--router-arg=--local-prefill-max-tokens=1152")
    parser.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument("--out-dir", default=None, metavar="DIR",
                        help="results, comparison and charts (default: a new temporary dir)")
    parser.add_argument("--no-progress", action="store_true")


def _heavy_rate(name: str) -> float | None:
    """The arrival rate of a `heavy-RATE` workload name (any rate > 0, e.g.
    heavy-0.8 for overload), else None."""
    if not name.startswith("heavy-"):
        return None
    try:
        rate = float(name.removeprefix("heavy-"))
    except ValueError:
        return None
    return rate if 0 < rate <= 100 else None


def _names(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    for name in names:
        if name not in allowed and not (allowed is WORKLOADS and _heavy_rate(name)):
            raise ValueError(f"{flag}: {name!r} is not one of {', '.join(allowed)}")
    if not names:
        raise ValueError(f"{flag} needs at least one entry")
    return names


def ratios(results: dict[str, dict[str, dict]], baseline: str = "colocated",
           ours_name: str = "disaggregated") -> dict[str, dict[str, float | None]]:
    """`ours_name` / `baseline` per workload and metric, where both ran."""
    out: dict[str, dict[str, float | None]] = {}
    for workload, per_topology in results.items():
        if not {ours_name, baseline} <= per_topology.keys():
            continue
        out[workload] = {}
        for label, read in METRICS:
            ours, theirs = read(per_topology[ours_name]), read(per_topology[baseline])
            out[workload][label] = ours / theirs if ours is not None and theirs else None
    return out


def print_comparison(results: dict[str, dict[str, dict]],
                     tables: dict[str, dict[str, dict[str, float | None]]]) -> None:
    """One row per workload and metric: each topology that ran, and each
    ratio in `tables` ("ours / baseline" -> `ratios`)."""
    def cell(value: float | None) -> str:
        return "—" if value is None else f"{value:,.1f}"

    ran = [t for t in TOPOLOGIES if any(t in p for p in results.values())]
    print(f"\n| workload | metric | {' | '.join(ran)} | "
          + "".join(f"{name} | " for name in tables) + "target |")
    print("|---|---|" + "---:|" * (len(ran) + len(tables)) + "---|")
    for workload, per_topology in results.items():
        for label, read in METRICS:
            values = [cell(read(per_topology[t])) if t in per_topology else "—" for t in ran]
            shares = [tables[b].get(workload, {}).get(label) for b in tables]
            print(f"| {workload} | {label} | {' | '.join(values)} | "
                  + "".join(f"{'—' if r is None else f'{r:.2f}x'} | " for r in shares)
                  + f"{target(workload, label)} |")
    errors = {f"{w}/{t}": r["errors"] for w, p in results.items() for t, r in p.items()}
    print(f"\nerrors: {errors}")


def run_topology(topology: str, up_args: list[str], model_dir: Path,
                 workloads: list[Workload], args: argparse.Namespace,
                 out_dir: Path) -> dict[str, dict]:
    """Start one topology, serve every workload on it, stop it."""
    ready = out_dir / f"up-{topology}.json"
    ready.unlink(missing_ok=True)
    argv = [*up_args, "--ready-file", str(ready), "--startup-timeout",
            str(args.startup_timeout), *[f"--pod-arg={a}" for a in args.pod_arg],
            *[f"--router-arg={a}" for a in args.router_arg]]
    if topology in DISAGGREGATED:
        argv += [f"--decode-arg={a}" for a in args.decode_arg]
        argv += [f"--prefill-arg={a}" for a in args.prefill_arg]
    log = out_dir / f"{topology}.log"
    print(f"[{topology}] starting pdserve up {' '.join(argv)} (log {log})", file=sys.stderr,
          flush=True)
    server = peer_servers.start_up(f"pdserve up ({topology})", str(model_dir), argv, log)
    results = {}
    try:
        model = server.wait_ready(args.startup_timeout)
        server.wait_file(ready, 60)
        urls = tuple(urls_from_up_ready_file(ready))
        for index, workload in enumerate(workloads):
            run = ServeRun(
                base_url=server.base_url, model=model, sessions=workload.sessions,
                spec=LoadSpec(max_tokens=1, concurrency=workload.concurrency or
                              sum(len(s.turns) for s in workload.sessions)),
                label=topology, workload={"name": workload.name, **workload.description},
                metrics_urls=urls, slo_ttft_ms=args.slo_ttft, slo_itl_ms=args.slo_itl,
                warmup=2 if index == 0 else 0, progress=not args.no_progress)
            result = {**run_benchmark(run), "topology": topology,
                      "up_command": server.command}
            print_summary({**result, "label": f"{workload.name} / {topology}"})
            (out_dir / f"{workload.name}-{topology}.json").write_text(
                json.dumps(result, indent=1, allow_nan=False))
            results[workload.name] = result
    finally:
        server.stop()
    return results


def main(args: argparse.Namespace) -> int:
    try:
        prefill_cpus = parse_cpu_list(args.prefill_cpus)
        decode_cpus = parse_cpu_list(args.decode_cpus)
        router_cpus = parse_cpu_list(args.router_cpus) if args.router_cpus else None
        if set(prefill_cpus) & set(decode_cpus):
            raise ValueError(f"--prefill-cpus {args.prefill_cpus} and --decode-cpus "
                             f"{args.decode_cpus} overlap; the comparison needs disjoint CPUs")
        names = _names(args.workloads, WORKLOADS, "--workloads")
        topologies = _names(args.topologies, TOPOLOGIES, "--topologies")
        for flag in ("num_requests", "light_requests", "trace_requests"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(args, flag)}")
        model_dir = peer_servers.model_dir(args.model)
        workloads = build_workloads(names, args, Vocabulary.from_model_dir(model_dir))
    except ValueError as exc:
        print(f"pdserve bench disagg: error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="pdserve-bench-disagg-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results: dict[str, dict[str, dict]] = {w.name: {} for w in workloads}
    for topology in topologies:
        up_args = topology_args(topology, prefill_cpus, decode_cpus, router_cpus)
        try:
            per_workload = run_topology(topology, up_args, model_dir, workloads, args, out_dir)
        except RuntimeError as exc:
            print(f"pdserve bench disagg: error: {exc}", file=sys.stderr)
            return 1
        for name, result in per_workload.items():
            results[name][topology] = result
    tables = {b: ratios(results, b) for b in BASELINES}
    shown = {f"disaggregated / {b}": t for b, t in tables.items() if t}
    shared = ratios(results, "colocated", "disaggregated-shared")
    if shared:
        shown["disaggregated-shared / colocated"] = shared
    print_comparison(results, shown)
    for name, per_topology in results.items():
        serve_plot.plot_runs(list(per_topology.values()), out_dir / "plots" / name)
    (out_dir / "comparison.json").write_text(json.dumps(
        {"model": str(model_dir), "prefill_cpus": format_cpu_list(prefill_cpus),
         "decode_cpus": format_cpu_list(decode_cpus), "started_unix": started,
         "wall_s": time.time() - started, "ratios": tables["colocated"],
         "ratios_dp": tables["colocated-dp"], "ratios_shared": shared,
         "targets": {w: {label: target(w, label) for label, _ in METRICS} for w in results},
         "runs": {w: {t: f"{w}-{t}.json" for t in p} for w, p in results.items()}},
        indent=1, allow_nan=False))
    print(f"\nresults, comparison.json and plots/ in {out_dir}")
    return 1 if any(r["errors"] for p in results.values() for r in p.values()) else 0

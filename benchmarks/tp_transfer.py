"""`pdserve bench tp-transfer`: TTFT of disaggregated serving between pods of
different tensor-parallel sizes, against TP=1 to TP=1, same prompt lengths.

One run starts a prefill pod and a decode pod at each size in `--sizes`
(real processes on loopback, the built-in `base` model by default) and, per
prompt length and repeat, interleaves (so drift hits every mix alike, each
over a fresh random prompt, prefix cache off):

- **prefill-only** at each prefill size (`Prefill.Prefill` with no target,
  as `bench ttft` measures it: what the prompt's computation alone costs at
  that size);
- **disaggregated** for every (prefill size, decode size) pair: the
  router's flow, `Decode.Generate(remote_prefill)` -> `Reserved` ->
  `Prefill.Prefill` with its target (every prefill rank sends its own KV
  heads to the decode ranks that hold them), TTFT = until the first token.

Reported per pair: TTFT median and minimum, the ratio to TP=1 -> TP=1 (the
issue's figure: <= 1.05x), and the ratio to prefill-only at the same
prefill size (what the transfer itself adds; on a CPU a TP=2 prefill is
slower than TP=1's on the same cores because of gloo's all-reduce, and
that part is `bench tp`'s, not the transfer's). KV bytes moved per request
are printed too: equal for every pair (no head is sent twice).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from pathlib import Path

HELP = "TTFT between prefill and decode pods of different TP sizes, against TP=1 -> TP=1."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base",
                        help="model dir, .gguf file or name: smollm2-135m-instruct, tiny, base")
    parser.add_argument("--sizes", default="1,2", help="TP sizes of the pods of each role")
    parser.add_argument("--prompt-lens", default="512,2048")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per length and mix")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--kv-streams", type=int, default=4)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="per pod")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write results here")


def _start(args: argparse.Namespace, sizes: list[int], lengths: list[int]) -> dict:
    from benchmarks.ttft import Pod
    from engine.model_source import resolve_model

    common = ["--model", str(resolve_model(args.model)), "--device", args.device,
              "--kv-cache-memory", args.kv_cache_memory,
              "--max-num-batched-tokens", str(max(2048, max(lengths)))]
    pods: dict = {}
    try:
        for size in sizes:
            tp = ["--tensor-parallel-size", str(size)]
            pods["prefill", size] = Pod("prefill", [*common, *tp, "--block-size", "16",
                                                    "--kv-streams", str(args.kv_streams),
                                                    "--no-prefix-cache"])
            pods["decode", size] = Pod("decode", [*common, *tp, "--block-size", "128",
                                                  "--kv-port", "0", "--transfer-timeout", "600"])
    except BaseException:
        for pod in pods.values():
            pod.stop()
        raise
    return pods


def main(args: argparse.Namespace) -> int:
    import grpc

    from benchmarks.ttft import measure_disaggregated, measure_prefill_only
    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc as pbg

    sizes = [int(x) for x in args.sizes.split(",")]
    lengths = [int(x) for x in args.prompt_lens.split(",")]
    pairs = list(itertools.product(sizes, sizes))
    pods = _start(args, sizes, lengths)
    results = []
    try:
        prefill = {s: pbg.PrefillStub(grpc.insecure_channel(pods["prefill", s].address))
                   for s in sizes}
        decode = {s: pbg.DecodeStub(grpc.insecure_channel(pods["decode", s].address))
                  for s in sizes}
        rng = random.Random(0)

        def prompt(length: int) -> list[int]:
            return [rng.randrange(5, 1000) for _ in range(length)]

        for i, (p, d) in enumerate(pairs * 2):  # warm every path
            measure_prefill_only(prefill[p], pb, f"warm-p-{i}", prompt(min(lengths)))
            measure_disaggregated(prefill[p], decode[d], pb, f"warm-d-{i}", prompt(min(lengths)))
        for length in lengths:
            alone = {s: [] for s in sizes}
            disagg = {pair: [] for pair in pairs}
            kv_bytes = {}
            for r in range(args.repeats):
                for s in sizes:
                    alone[s].append(measure_prefill_only(prefill[s], pb, f"p{s}-{length}-{r}",
                                                         prompt(length)))
                for p, d in pairs:
                    ttft, kv_bytes[p, d] = measure_disaggregated(
                        prefill[p], decode[d], pb, f"d{p}{d}-{length}-{r}", prompt(length))
                    disagg[p, d].append(ttft)
                print(f"prompt {length} #{r}: " + ", ".join(
                    f"P{p}->D{d} {disagg[p, d][-1] * 1e3:.0f} ms" for p, d in pairs),
                    file=sys.stderr, flush=True)
            for p, d in pairs:
                results.append({
                    "prompt_len": length, "prefill_tp": p, "decode_tp": d,
                    "ttft_ms": statistics.median(disagg[p, d]) * 1e3,
                    "ttft_min_ms": min(disagg[p, d]) * 1e3,
                    "prefill_only_ms": statistics.median(alone[p]) * 1e3,
                    "prefill_only_min_ms": min(alone[p]) * 1e3,
                    "kv_bytes": kv_bytes[p, d]})
    finally:
        for pod in pods.values():
            pod.stop()
    _print_table(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _print_table(args: argparse.Namespace, results: list[dict]) -> None:
    print(f"model={args.model} device={args.device} streams={args.kv_streams} "
          f"repeats={args.repeats}; medians (min)")
    print("| prompt | prefill TP -> decode TP | TTFT ms | / TP=1 -> TP=1 | prefill-only ms "
          "at that prefill TP | transfer's share: TTFT / prefill-only | KV bytes |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    base = {r["prompt_len"]: r for r in results if r["prefill_tp"] == r["decode_tp"] == 1}
    for r in results:
        one = base.get(r["prompt_len"])
        ratio = "" if one is None else f"{r['ttft_ms'] / one['ttft_ms']:.3f}x"
        print(f"| {r['prompt_len']} | {r['prefill_tp']} -> {r['decode_tp']} | "
              f"{r['ttft_ms']:.1f} ({r['ttft_min_ms']:.1f}) | {ratio} | "
              f"{r['prefill_only_ms']:.1f} ({r['prefill_only_min_ms']:.1f}) | "
              f"{r['ttft_ms'] / r['prefill_only_ms']:.3f}x | {r['kv_bytes']:,} |")

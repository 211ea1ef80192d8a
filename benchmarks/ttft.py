"""`pdserve bench ttft`: time to first token, disaggregated vs prefill-only.

One run, one prefill pod and one decode pod (real processes on loopback),
the built-in `base` model by default:

- **prefill-only** (baseline): `Prefill.Prefill` with an empty target (no
  endpoints = no KV transfer); TTFT = until the stream's first message.
- **disaggregated**: the router's flow: open `Decode.Generate(remote_prefill)`,
  read `Reserved`, call `Prefill.Prefill` with its target; TTFT = time from
  opening the decode stream until the first token is in the client's hand
  (the Prefill stream's first message, sent as soon as the prefill pod
  sampled it, before the decode pod's verdict on the transfer). Includes the
  reservation round trip; the tail of the transfer now overlaps the client's
  wait for token 1 instead.

With `--local`, a third mode: **decode-local** (conditional disaggregation,
`pdserve router --local-prefill-below`): `Decode.Generate(remote_prefill,
local_prefill_below)` on the decode pod, which computes the prompt itself
and answers with tokens instead of Reserved; TTFT = until its first tokens
message. Against disaggregated, per prompt length, it shows where local
prefill stops paying (the crossover the router's threshold is set from).
`--decode-load N` keeps N sequences decoding on the decode pod meanwhile
(as in service: a local prefill shares the pod's steps with its batch).

Both run at low load (one request at a time), interleaved so drift hits
both alike, over fresh random prompts (prefix cache off on the prefill pod,
so every request computes its whole prompt). Reports the median and the
minimum per prompt length (on a shared machine the minimum is the figure
least disturbed by other work) and their ratios; the target is
disaggregated <= 1.02x prefill-only.

The pods share every CPU unless `--prefill-cpus` / `--decode-cpus` pin them
(as deployed: each pod on its own cores or node). Shared, the decode pod's
receiving and injecting runs on the cores the prefill computes on and is
charged to the disaggregated TTFT; pinned apart, only the path's own cost
is (the reservation round trip, the prefill pod's sending).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HELP = "TTFT: disaggregated (prefill pod -> decode pod) vs prefill-only, several prompt lengths."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base",
                        help="model dir, .gguf file or name: smollm2-135m-instruct, tiny, base")
    parser.add_argument("--prompt-lens", default="128,512,2048",
                        help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per length and mode")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--kv-transport", default="tcp", choices=("tcp", "grpc"))
    parser.add_argument("--kv-streams", type=int, default=4)
    parser.add_argument("--prefill-block-size", type=int, default=16)
    parser.add_argument("--decode-block-size", type=int, default=128)
    parser.add_argument("--kv-cache-memory", default="2GiB", help="per pod")
    parser.add_argument("--local", action="store_true",
                        help="also time the decode pod prefilling the prompt itself "
                             "(conditional disaggregation) against disaggregated")
    parser.add_argument("--decode-load", type=int, default=0, metavar="N",
                        help="sequences kept decoding on the decode pod meanwhile (default 0)")
    parser.add_argument("--prefill-cpus", default=None, metavar="LIST",
                        help="pin the prefill pod to these CPUs (its --cpus; default unpinned)")
    parser.add_argument("--decode-cpus", default=None, metavar="LIST",
                        help="pin the decode pod to these CPUs (its --cpus; default unpinned)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write results here")


def _model_dir(name: str) -> str:
    from engine.model_source import resolve_model

    return str(resolve_model(name))


class Pod:
    """A pod subprocess on loopback with OS-picked ports (see --ready-file)."""

    def __init__(self, command: str, flags: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"pdserve-bench-{command}-"))
        ready = self.dir / "ready.json"
        self.log = open(self.dir / "pod.log", "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve", command, "--host", "127.0.0.1", "--port", "0",
             "--metrics-port", "0", "--ready-file", str(ready), *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 600
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdserve {command} did not start; see {self.dir / 'pod.log'}:"
                                   f"\n{(self.dir / 'pod.log').read_text()[-3000:]}")
            time.sleep(0.1)
        self.address = f"127.0.0.1:{json.loads(ready.read_text())['grpc']}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


def _pinned(cpus: str | None) -> list[str]:
    return [] if cpus is None else ["--cpus", cpus]


def measure_prefill_only(prefill, pb, rid: str, prompt: list[int]) -> float:
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    start = time.perf_counter()
    messages = prefill.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                                 sampling=sampling), timeout=600)
    next(messages)  # the first token
    ttft = time.perf_counter() - start
    for _ in messages:  # transfer_done (no transfer here)
        pass
    return ttft


def measure_disaggregated(prefill, decode, pb, rid: str, prompt: list[int]) -> tuple[float, int]:
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    start = time.perf_counter()
    call = decode.Generate(pb.DecodeGenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=sampling, remote_prefill=True),
        timeout=600)
    reserved = next(call).reserved
    messages = prefill.Prefill(pb.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=sampling, target=reserved.target),
        timeout=600)
    next(messages)  # the first token, streamed before the transfer's verdict
    ttft = time.perf_counter() - start
    (done,) = messages
    for _ in call:  # the decode stream finishes the request (not timed)
        pass
    return ttft, done.transfer_done.kv_bytes_sent


def _measure_local(decode, pb, rid: str, prompt: list[int]) -> float:
    """The decode pod prefills the prompt itself (local_prefill_below above its length)."""
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    start = time.perf_counter()
    call = decode.Generate(pb.DecodeGenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=sampling, remote_prefill=True,
        local_prefill_below=len(prompt) + 1), timeout=600)
    first = next(call)
    ttft = time.perf_counter() - start
    if first.WhichOneof("kind") != "tokens":
        call.cancel()
        raise RuntimeError(f"the decode pod answered {first.WhichOneof('kind')}, not tokens")
    for _ in call:
        pass
    return ttft


def _decode_load(decode, pb, num_seqs: int, stop: threading.Event) -> list[threading.Thread]:
    """`num_seqs` threads, each keeping one long sequence decoding on the decode pod."""
    def run(i: int) -> None:
        rng = random.Random(1000 + i)
        n = 0
        while not stop.is_set():
            n += 1
            call = decode.Generate(pb.DecodeGenerateRequest(
                request_id=f"load-{i}-{n}", prompt_token_ids=[rng.randrange(5, 1000)
                                                              for _ in range(64)],
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)),
                timeout=600)
            for _ in call:
                if stop.is_set():
                    call.cancel()
                    break

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(num_seqs)]
    for thread in threads:
        thread.start()
    return threads


def main(args: argparse.Namespace) -> int:
    import grpc

    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc as pbg

    lengths = [int(x) for x in args.prompt_lens.split(",")]
    model = _model_dir(args.model)
    common = ["--model", model, "--device", args.device, "--kv-cache-memory",
              args.kv_cache_memory, "--max-num-batched-tokens", str(max(2048, max(lengths)))]
    prefill_pod = Pod("prefill", [*common, "--block-size", str(args.prefill_block_size),
                                   "--kv-streams", str(args.kv_streams), "--no-prefix-cache",
                                   *_pinned(args.prefill_cpus)])
    decode_pod = None
    try:
        # a CPU prefill of thousands of tokens on a shared machine can take
        # longer than the default 30 s transfer timeout
        decode_pod = Pod("decode", [*common, "--block-size", str(args.decode_block_size),
                                     "--kv-port", "0", "--kv-transport", args.kv_transport,
                                     "--transfer-timeout", "600", *_pinned(args.decode_cpus)])
        prefill = pbg.PrefillStub(grpc.insecure_channel(prefill_pod.address))
        decode = pbg.DecodeStub(grpc.insecure_channel(decode_pod.address))
        rng = random.Random(0)
        results = []
        stop_load = threading.Event()
        load = _decode_load(decode, pb, args.decode_load, stop_load)
        # warm up both paths (first calls pay for lazy initialisation)
        for i in range(2):
            warm = [rng.randrange(5, 1000) for _ in range(min(lengths))]
            measure_prefill_only(prefill, pb, f"warm-p-{i}", warm)
            measure_disaggregated(prefill, decode, pb, f"warm-d-{i}", warm)
        for length in lengths:
            base, disagg, kv_bytes = [], [], 0
            local: list[float] = []
            for r in range(args.repeats):
                prompt = [rng.randrange(5, 1000) for _ in range(length)]
                other = [rng.randrange(5, 1000) for _ in range(length)]
                base.append(measure_prefill_only(prefill, pb, f"p-{length}-{r}", prompt))
                ttft, kv_bytes = measure_disaggregated(prefill, decode, pb,
                                                        f"d-{length}-{r}", other)
                disagg.append(ttft)
                line = (f"prompt {length} #{r}: prefill-only {base[-1] * 1e3:.1f} ms, "
                        f"disaggregated {ttft * 1e3:.1f} ms")
                if args.local:
                    third = [rng.randrange(5, 1000) for _ in range(length)]
                    local.append(_measure_local(decode, pb, f"l-{length}-{r}", third))
                    line += f", decode-local {local[-1] * 1e3:.1f} ms"
                print(line, file=sys.stderr, flush=True)
            row = {"prompt_len": length, "prefill_only_ms": statistics.median(base) * 1e3,
                   "disaggregated_ms": statistics.median(disagg) * 1e3,
                   "prefill_only_min_ms": min(base) * 1e3,
                   "disaggregated_min_ms": min(disagg) * 1e3, "kv_bytes": kv_bytes}
            if local:
                row.update(local_ms=statistics.median(local) * 1e3, local_min_ms=min(local) * 1e3)
            results.append(row)
        stop_load.set()
        for thread in load:
            thread.join(60)
    finally:
        for pod in (decode_pod, prefill_pod):
            if pod is not None:
                pod.stop()
    _print_table(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _print_table(args: argparse.Namespace, results: list[dict]) -> None:
    print(f"model={args.model} device={args.device} transport={args.kv_transport} "
          f"streams={args.kv_streams} prefill block={args.prefill_block_size} "
          f"decode block={args.decode_block_size} repeats={args.repeats} "
          f"prefill cpus={args.prefill_cpus or 'all'} decode cpus={args.decode_cpus or 'all'}")
    print("| prompt tokens | prefill-only TTFT median / min (ms) | disaggregated TTFT median / "
          "min (ms) | ratio of medians | ratio of mins | KV bytes |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in results:
        ratio = row["disaggregated_ms"] / row["prefill_only_ms"]
        ratio_min = row["disaggregated_min_ms"] / row["prefill_only_min_ms"]
        print(f"| {row['prompt_len']} | {row['prefill_only_ms']:.1f} / "
              f"{row['prefill_only_min_ms']:.1f} | {row['disaggregated_ms']:.1f} / "
              f"{row['disaggregated_min_ms']:.1f} | {ratio:.3f} | {ratio_min:.3f} | "
              f"{row['kv_bytes']:,} |")
    if any("local_ms" in row for row in results):
        print(f"\ndecode-local vs disaggregated (decode load {args.decode_load} sequences)")
        print("| prompt tokens | decode-local TTFT median / min (ms) | disaggregated TTFT "
              "median / min (ms) | local / disaggregated (medians) |")
        print("|---:|---:|---:|---:|")
        for row in results:
            print(f"| {row['prompt_len']} | {row['local_ms']:.1f} / {row['local_min_ms']:.1f} | "
                  f"{row['disaggregated_ms']:.1f} / {row['disaggregated_min_ms']:.1f} | "
                  f"{row['local_ms'] / row['disaggregated_ms']:.3f} |")

"""`pdserve bench sim-profile`: a simulator profile measured from this
machine's real engine (issue 43: "one profile measured from this machine's
real pods, `pdserve bench` writes it").

The simulated pods' performance model (sim/perf_model.py) is linear in what
a step plans:

    step = overhead + a x prompt tokens + b x decode rows + c x context tokens

This benchmark runs the real engine in-process, with the threads a pinned
pod gets (`--threads`, default 1: `pdserve bench disagg` and `sim-check`
pin each pod to one core), through steps of known shape:

    prefill   one prompt of each --prefill-lens alone (one step each)
    decode    --decode-batches sequences at each --decode-contexts, decoding
              --decode-steps steps (the context grows by one per step)
    mixed     a prompt chunk beside a running batch (the scheduler's own
              mixed steps), so the fit sees both terms at once

Every step's plan is read from the scheduler (the same rows `PerfModel`
reads: a row of one token past its prompt is a decode row), its wall time
measured around `LLMEngine.step()`, and the four coefficients fitted by
least squares (non-negative: a coefficient the fit puts below zero is held
at zero and the rest refitted; each shape weighted by the inverse of its
time, so the fit minimises relative error). Repeats (`--repeats`) are fitted on their
median per shape. The link terms and the KV cache size are not measured
here: they come from `--link-from` (a profile, default cpu-base, whose
source is `pdserve bench transfer`) and `--kv-cache-bytes`.

The profile JSON it writes (`--out`) says where every number came from:
the command, the commit, the CPU, and each measured shape beside the
model's prediction.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HELP = ("A simulator performance profile measured from the real engine on this machine: "
        "prefill, decode and mixed steps timed and fitted (sim/perf_model.py's formula).")

FEATURES = ("step_overhead_s", "prefill_s_per_token", "decode_s_per_seq",
            "decode_s_per_context_token")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base", help="model dir or built-in name")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads, as a pod pinned to that many cores runs")
    parser.add_argument("--prefill-lens", default="64,256,512,1024")
    parser.add_argument("--decode-batches", default="1,4,8,16")
    parser.add_argument("--decode-contexts", default="128,512")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--link-from", default="cpu-base",
                        help="profile whose link terms (bytes/s, latency) are kept")
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--name", default="cpu-measured")
    parser.add_argument("--out", default=None, help="write the profile JSON here")


def plan_features(plan) -> tuple[int, int, int]:
    """(prompt tokens, decode rows, context tokens) of one scheduler plan,
    counted exactly as the simulator counts them."""
    from sim.perf_model import plan_shape

    return plan_shape(plan)


class StepRecorder:
    """Times `engine.step()` and keeps each step's plan features beside it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.samples: list[tuple[tuple[int, int, int], float]] = []
        self._last: tuple[int, int, int] | None = None
        schedule = engine.scheduler.schedule

        def recording_schedule(*a, **kw):
            plan = schedule(*a, **kw)
            self._last = plan_features(plan)
            return plan

        engine.scheduler.schedule = recording_schedule

    def step(self) -> list:
        self._last = None
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        if self._last is not None and any(self._last):
            self.samples.append((self._last, seconds))
        return outputs

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()


def fit(samples: list[tuple[tuple[int, int, int], float]]) -> dict[str, float]:
    """Non-negative least squares of step time on (1, prompt, rows, context),
    in relative error: the coefficients `PerfModel` takes. A shape measured
    several times counts once, at its median."""
    import torch

    by_shape: dict[tuple[int, int, int], list[float]] = {}
    for shape, seconds in samples:
        by_shape.setdefault(shape, []).append(seconds)
    shapes = sorted(by_shape)
    x = torch.tensor([[1.0, *s] for s in shapes], dtype=torch.float64)
    y = torch.tensor([statistics.median(by_shape[s]) for s in shapes], dtype=torch.float64)
    # relative error is what matters: a 35 ms decode step off by 9 ms is worse
    # than a 3.5 s prefill off by 9 ms, so each row is weighted by 1 / its time
    x, y = x / y.unsqueeze(1), torch.ones_like(y)
    # columns scaled to unit norm (context counts are 10^3-10^5 times the
    # others); a feature no measured step has stays 0
    norms = x.norm(dim=0)
    active = [i for i in range(len(FEATURES)) if norms[i] > 0]
    while True:
        scaled = x[:, active] / norms[active]
        solution = torch.linalg.lstsq(scaled, y.unsqueeze(1), driver="gelsd").solution
        solution = solution.squeeze(1) / norms[active]
        negative = [active[i] for i, v in enumerate(solution.tolist()) if v < 0]
        if not negative:
            break
        active = [i for i in active if i not in negative]
    coefficients = dict.fromkeys(FEATURES, 0.0)
    for i, value in zip(active, solution.tolist(), strict=True):
        coefficients[FEATURES[i]] = float(value)
    return coefficients


def predicted(coefficients: dict[str, float], shape: tuple[int, int, int]) -> float:
    values = (1, *shape)
    return sum(coefficients[f] * v for f, v in zip(FEATURES, values, strict=True))


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def measure(args: argparse.Namespace) -> tuple[list, dict]:
    """Run the shapes on a real engine; (samples, what ran)."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_source import resolve_model
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    prefill_lens, batches = _ints(args.prefill_lens), _ints(args.decode_batches)
    contexts = _ints(args.decode_contexts)
    longest = max(prefill_lens + [c + args.decode_steps + 2 for c in contexts])
    block_size = 16
    num_blocks = (max(batches + [8]) + 2) * -(-longest // block_size) + 16
    model_dir = str(resolve_model(args.model))
    engine = LLMEngine(EngineConfig(
        model_dir=model_dir, dtype=args.dtype, device="cpu", block_size=block_size,
        num_blocks=num_blocks, max_num_seqs=max(batches + [8]) + 1,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max(prefill_lens)),
        enable_prefix_caching=False))
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    recorder = StepRecorder(engine)
    serial = iter(range(1 << 30))

    def prompt(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    def add(n: int, max_tokens: int) -> None:
        engine.add_request(f"profile-{next(serial)}", prompt(n),
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))

    add(64, 4)  # warm-up: the first steps pay one-time costs
    recorder.drain()
    recorder.samples.clear()
    for _ in range(args.repeats):
        for n in prefill_lens:
            add(n, 1)
            recorder.drain()
        for context in contexts:
            for batch in batches:
                for _ in range(batch):
                    add(context, args.decode_steps + 1)
                recorder.drain()
        # mixed: a prompt arriving while a batch decodes
        for _ in range(8):
            add(contexts[0], args.decode_steps + 4)
        recorder.step()
        add(prefill_lens[len(prefill_lens) // 2], 1)
        recorder.drain()
    what = {"model": model_dir, "dtype": args.dtype, "threads": args.threads,
            "layers": engine.model_config.num_hidden_layers,
            "hidden": engine.model_config.hidden_size}
    return recorder.samples, what


def _provenance(args: argparse.Namespace) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"command": "pdserve bench sim-profile " + " ".join(sys.argv[3:]),
            "commit": commit, "cpu": cpu or platform.processor(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def build_profile(args: argparse.Namespace, samples: list, what: dict) -> dict:
    from sim.perf_model import load_profile, profile_from_dict

    coefficients = fit(samples)
    link = load_profile(args.link_from)
    by_shape: dict[tuple[int, int, int], list[float]] = {}
    for shape, seconds in samples:
        by_shape.setdefault(shape, []).append(seconds)
    points = [{"prompt_tokens": s[0], "decode_rows": s[1], "context_tokens": s[2],
               "measured_ms": round(1e3 * statistics.median(v), 3),
               "predicted_ms": round(1e3 * predicted(coefficients, s), 3), "samples": len(v)}
              for s, v in sorted(by_shape.items())]
    origin = _provenance(args)
    profile = {
        "name": args.name,
        "description": (f"{what['model']} ({what['layers']} layers, hidden {what['hidden']}, "
                        f"{what['dtype']}) on {what['threads']} thread(s) of {origin['cpu']}, "
                        f"measured by pdserve bench sim-profile"),
        **{k: round(v, 9) for k, v in coefficients.items()},
        "link_bytes_per_s": link.link_bytes_per_s,
        "link_latency_s": link.link_latency_s,
        "kv_cache_bytes": args.kv_cache_bytes,
        "derivation": {"steps": "least squares over the measured step shapes below "
                                "(median per shape), non-negative",
                       "link": f"kept from profile {link.name!r}",
                       "measured": origin, "points": points},
        "sources": [origin["command"]],
    }
    profile_from_dict(profile, source="measured profile")  # the simulator must accept it
    return profile


def main(args: argparse.Namespace) -> int:
    samples, what = measure(args)
    profile = build_profile(args, samples, what)
    print("| prompt tokens | decode rows | context | measured ms | model ms | error |")
    print("|---:|---:|---:|---:|---:|---:|")
    for p in profile["derivation"]["points"]:
        error = p["predicted_ms"] / p["measured_ms"] - 1 if p["measured_ms"] else 0.0
        print(f"| {p['prompt_tokens']} | {p['decode_rows']} | {p['context_tokens']} "
              f"| {p['measured_ms']:.2f} | {p['predicted_ms']:.2f} | {error:+.0%} |")
    print("coefficients: " + ", ".join(f"{k} {profile[k]:.3g}" for k in FEATURES))
    if args.out:
        Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
        print(f"profile written to {args.out} (pdserve sim --profile {args.out})")
    return 0

"""The native causal prefill attention (`kernels/native/prefill_attention.c`) on CPU.

Two measurements, each A against B interleaved in one process (on a
shared machine drift then hits both alike):

- **kernel**: `kernels.native.prefill_attention` against the engine's torch
  path (`PagedAttentionContext._torch_chunk_attention`: q, k and v
  transposed into contiguous 4-D copies, then torch's flash SDPA, causal,
  GQA), over one layer of a whole prompt of L tokens, q / k as RoPE leaves
  them (contiguous) and v a view of the qkv projection's rows, as the
  engine passes them. Per L: rounds of `--calls` calls of each in turn; a
  round's figure is its fastest call; reported are the median and the
  minimum of the rounds, GFLOPS at the median (2 D Hq L (L + 1) / 2
  multiply-adds of the visible query-key pairs, two per pair and
  dimension, counted as 2 operations each) and the speedup of the medians;
- **engine** (`--engine-prompt N`, 0 to skip): an `LLMEngine` generating one
  token for an N-token random prompt (prefill only, prefix caching off),
  with the native kernel and with SDPA (`supports_prefill_attention`
  patched to False for that arm), alternating, median and min of the
  rounds.

Shapes default to the `base` model's attention (16 query heads, 4 KV heads,
head_dim 64), float32, two threads. About two minutes with the defaults.
On a machine shared with other work, `--threads 1 --cpu-time
--engine-prompt 0` compares the kernels by the CPU time they got.

    PYTHONPATH=. python -m benchmarks.native_prefill_attention

(as a module: run as a script, `benchmarks/kernels.py` would shadow the
`kernels` package).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch

from engine.layer_attention import LayerAttention
from engine.paged_attention_context import PagedAttentionContext
from kernels import native

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def interleaved(arms: dict[str, Callable[[], object]], *, rounds: int, calls: int,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per round for each arm: the fastest of `calls` calls, the arms
    taking turns round by round (after one warm-up call each)."""
    for fn in arms.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            best = float("inf")
            for _ in range(calls):
                t0 = clock()
                fn()
                best = min(best, clock() - t0)
            samples[name].append(best)
    return samples


def layer_inputs(length: int, args: argparse.Namespace):
    """q, k [L, H, D] contiguous (RoPE's outputs) and v a view of qkv rows."""
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(length)
    q = torch.randn(length, args.q_heads, args.head_dim, generator=gen).to(dtype)
    k = torch.randn(length, args.kv_heads, args.head_dim, generator=gen).to(dtype)
    qkv = torch.randn(length, (args.q_heads + 2 * args.kv_heads) * args.head_dim,
                      generator=gen).to(dtype)
    v = qkv[:, (args.q_heads + args.kv_heads) * args.head_dim:].view(
        length, args.kv_heads, args.head_dim)
    return q, k, v


def kernel_table(args: argparse.Namespace) -> None:
    scale = args.head_dim ** -0.5
    spec = LayerAttention(scale, None)
    print(f"kernel: one layer, whole prompt; dtype {args.dtype}, Hq {args.q_heads}, "
          f"Hkv {args.kv_heads}, D {args.head_dim}, torch threads {torch.get_num_threads()}; "
          f"{args.rounds} rounds x {args.calls} calls, ms per call "
          f"({'CPU time of the calling thread' if args.cpu_time else 'wall clock'})")
    print("| L | SDPA median | SDPA min | native median | native min | SDPA GFLOPS | "
          "native GFLOPS | speedup (medians) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        q, k, v = layer_inputs(length, args)
        sdpa = PagedAttentionContext._torch_chunk_attention
        got = native.prefill_attention(q, k, v, scale=scale)
        diff = (got.float() - sdpa(q, k, v, spec).float()).abs().max().item()
        if diff > (1e-4 if args.dtype == "fp32" else 2e-2):
            raise SystemExit(f"L={length}: native and SDPA differ by {diff}")
        samples = interleaved({
            "sdpa": functools.partial(sdpa, q, k, v, spec),
            "native": functools.partial(native.prefill_attention, q, k, v, scale=scale),
        }, rounds=args.rounds, calls=args.calls,
            clock=time.thread_time if args.cpu_time else time.perf_counter)
        flops = 4.0 * length * (length + 1) / 2 * args.head_dim * args.q_heads
        med = {name: statistics.median(s) for name, s in samples.items()}
        low = {name: min(s) for name, s in samples.items()}
        print(f"| {length} | {med['sdpa'] * 1e3:.2f} | {low['sdpa'] * 1e3:.2f} | "
              f"{med['native'] * 1e3:.2f} | {low['native'] * 1e3:.2f} | "
              f"{flops / med['sdpa'] / 1e9:.1f} | {flops / med['native'] / 1e9:.1f} | "
              f"{med['sdpa'] / med['native']:.2f}x |", flush=True)


def engine_table(args: argparse.Namespace) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_source import resolve_model
    from engine.sampling_params import SamplingParams

    model_dir = str(resolve_model(args.model))
    engine = LLMEngine(EngineConfig(
        model_dir=model_dir, dtype={"fp32": "float32", "bf16": "bfloat16",
                                    "fp16": "float16"}[args.dtype],
        block_size=16, num_blocks=-(-args.engine_prompt // 16) + 8, max_num_seqs=1,
        max_num_batched_tokens=max(2048, args.engine_prompt), enable_prefix_caching=False))
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, vocab, (args.engine_prompt,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prefill(use_native: bool) -> Callable[[], object]:
        off = mock.patch.object(native, "supports_prefill_attention", lambda *a: False)
        context = contextlib.nullcontext() if use_native else off

        def run() -> object:
            with context:
                return engine.generate([prompt], params)
        return run

    arms = {"sdpa": prefill(False), "native": prefill(True)}
    first = {name: fn()[0].token_ids for name, fn in arms.items()}
    samples = interleaved(arms, rounds=args.engine_rounds, calls=1)
    med = {name: statistics.median(s) for name, s in samples.items()}
    low = {name: min(s) for name, s in samples.items()}
    print(f"\nengine: {model_dir} ({engine.model_config.num_hidden_layers} layers), "
          f"{args.engine_prompt}-token prompt, 1 token, {args.engine_rounds} rounds; "
          f"same first token: {first['sdpa'] == first['native']}")
    print("| prefill attention | median ms | min ms |")
    print("|---|---:|---:|")
    for name in arms:
        print(f"| {name} | {med[name] * 1e3:.1f} | {low[name] * 1e3:.1f} |")
    print(f"native / SDPA: median {med['native'] / med['sdpa']:.3f}, "
          f"min {low['native'] / low['sdpa']:.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[256, 1024, 2048, 4096],
                        help="prompt lengths of the kernel table (none: skip it)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=3, help="calls per arm and round")
    parser.add_argument("--cpu-time", action="store_true",
                        help="with --threads 1: time the kernels by the calling thread's CPU "
                             "time, which leaves out the time other processes had the core")
    parser.add_argument("--model", default="base",
                        help="engine model: a directory, or 'tiny' / 'base' (built-in)")
    parser.add_argument("--engine-prompt", type=int, default=1024,
                        help="prompt tokens of the engine measurement; 0 skips it")
    parser.add_argument("--engine-rounds", type=int, default=9)
    args = parser.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time needs --threads 1 (the work runs on the calling thread)")
    if not native.prefill_attention_available():
        raise SystemExit("native prefill attention unavailable (no compiler, or no AVX2 + FMA)")
    torch.set_num_threads(args.threads)
    if args.lengths:
        kernel_table(args)
    if args.engine_prompt:
        engine_table(args)


if __name__ == "__main__":
    main()

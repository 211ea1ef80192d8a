"""The dense projections of a prefill on CPU: the native panel GEMM
(kernels/native/gemm.c, its 6-row tiles from 24 rows) against oneDNN's
prepacked inner product, per row count.

Weights are a whole model's per-layer projections (`--model`'s qkv, o,
gate_up and down, every layer; not lm_head, which a prefill runs on its
sampled rows only), random, each its own tensor, so a pass reads them as a
forward does. A round times one pass of each path over every weight, in
alternating order (native first in even rounds, oneDNN first in odd), so a
noisy machine slows both alike; the table gives, per row count, the median
and min of `--rounds` passes, the GFLOPS of the medians, and oneDNN's time
over native's: of the medians, and the median of the rounds' own ratios.

`--dtype bfloat16` times the bfloat16 panels (kernels/native/gemm_bf16.c:
k in pairs on AVX512-BF16) against oneDNN's bfloat16 inner product, or,
on a CPU where oneDNN has none, against the float32-upcast oneDNN path an
engine would take there (`Linear.prepack_onednn`).

`--engine-prompt-len N` then times the same two paths end to end: two
engines of the model (`--dtype`, `decode_matmul` native: every projection
on the native GEMM; off: on oneDNN), a random N-token prompt generating
one token, alternating engines for `--rounds` rounds (needs a model, not
only its shapes: 'base' is made on first use).
"""

from __future__ import annotations

import argparse
import statistics
import time

HELP = ("Prefill projections on CPU: the native panel GEMM against oneDNN prepacked, "
        "interleaved in one process, per row count.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base",
                        help="model directory, or 'tiny' / 'base' (its shapes only)")
    parser.add_argument("--rows", default="32,64,128,256,512,1024,2048",
                        help="comma-separated row counts (prompt tokens in one forward)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads, and the native GEMM's (default: torch's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the weights' and rows' type (bfloat16: gemm_bf16.c's panels)")
    parser.add_argument("--by-shape", action="store_true",
                        help="also a row per projection shape (medians of the same rounds)")
    parser.add_argument("--engine-prompt-len", type=int, default=0,
                        help="then the prefill of an N-token prompt end to end, native "
                             "against oneDNN engines (0: skip)")


def _engine_prefill(model: str, prompt_len: int, rounds: int, dtype: str) -> None:
    """Median and min ms of generating 1 token from a `prompt_len`-token
    prompt, engines with every projection on the native GEMM and on oneDNN,
    alternating."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_source import resolve_model
    from engine.sampling_params import SamplingParams

    model_dir = resolve_model(model)
    engines = {}
    for name, decode_matmul in (("native", "native"), ("oneDNN", "off")):
        engines[name] = LLMEngine(EngineConfig(
            model_dir=model_dir, dtype=dtype, device="cpu", num_blocks=prompt_len // 16 + 8,
            max_num_seqs=1, max_num_batched_tokens=max(2048, prompt_len),
            enable_prefix_caching=False, decode_matmul=decode_matmul))
    assert engines["native"].native_gemm and not engines["oneDNN"].native_gemm
    vocab = engines["native"].model_config.vocab_size
    prompt = torch.randint(10, vocab, (prompt_len,), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {}
    for i in range(rounds + 1):  # round 0: warm-up
        for name in (("native", "oneDNN") if i % 2 == 0 else ("oneDNN", "native")):
            start = time.perf_counter()
            tokens[name] = engines[name].generate([prompt.tolist()], params)[0].token_ids
            if i:
                times[name].append((time.perf_counter() - start) * 1e3)
    print(f"\nprefill of a {prompt_len}-token prompt, 1 token generated, {rounds} rounds "
          f"(same greedy token: {tokens['native'] == tokens['oneDNN']}):")
    print("| engine | ms, median (min) |")
    print("|---|---:|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.0f} ({min(t):.0f}) |")
    ratio = statistics.median(o / n for n, o in zip(times["native"], times["oneDNN"],
                                                      strict=True))
    print(f"| oneDNN / native, median of round ratios | {ratio:.2f}x |", flush=True)


def main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.decode_gemm import _shapes
    from engine.layers.linear import upcasts_bfloat16
    from kernels import native

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    bf16 = args.dtype == "bfloat16"
    if not (native.gemm_bf16_available() if bf16 else native.gemm_available()):
        print("native GEMM unavailable here (no C compiler, or no AVX2 + FMA)")
        return 1
    dtype = torch.bfloat16 if bf16 else torch.float32
    # oneDNN's side as an engine packs it: bfloat16 upcast where oneDNN has no bfloat16 linear
    onednn_dtype = torch.float32 if bf16 and upcasts_bfloat16() else dtype
    pack = native.pack_panels_bf16 if bf16 else native.pack_panels
    gemm = native.gemm_panels_bf16 if bf16 else native.gemm_panels
    shapes = _shapes(args.model)[:-1]  # no lm_head
    g = torch.Generator().manual_seed(0)
    panels, packed = [], []
    for k, n in shapes:
        weight = torch.randn(n, k, generator=g).to(dtype)
        panels.append(pack(weight))
        packed.append(torch.ops.mkldnn._reorder_linear_weight(weight.to(onednn_dtype), None))
    kinds = sorted(set(shapes), key=shapes.index)
    names = ", ".join(f"{k}x{n}" for k, n in kinds)
    megabytes = sum(p.numel() * p.element_size() for p in panels) / 1e6
    pairs = " (k in pairs)" if bf16 and native.gemm_bf16_pairs() else ""
    print(f"model {args.model}: {len(shapes)} projections ({names}), {megabytes:.0f} MB "
          f"{args.dtype}{pairs}, oneDNN in {str(onednn_dtype).removeprefix('torch.')}, "
          f"torch threads {torch.get_num_threads()}, {args.rounds} rounds")
    print("| rows | native ms (min) | oneDNN ms (min) | native GFLOPS | oneDNN GFLOPS | "
          "oneDNN / native | median of round ratios |")
    print("|---:|---:|---:|---:|---:|---:|---:|")

    def one_pass(xs: dict[int, torch.Tensor], mine: bool, per_shape: dict) -> float:
        total = 0.0
        for (k, n), p, q in zip(shapes, panels, packed, strict=True):
            start = time.perf_counter()
            if mine:
                gemm(xs[k], p, n)
            else:
                x = xs[k].to(onednn_dtype)  # a no-op unless upcast, as in the engine
                torch.ops.mkldnn._linear_pointwise(x, q, None, "none", [], "")
            took = time.perf_counter() - start
            per_shape.setdefault((k, n), []).append(took)
            total += took
        return total * 1e3

    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k, _ in kinds}
            flops = 2 * rows * sum(k * n for k, n in shapes)
            times: dict[bool, list[float]] = {True: [], False: []}
            shape_times: dict[bool, dict] = {True: {}, False: {}}
            for mine in (True, False):  # warm-up
                one_pass(xs, mine, {})
            for i in range(args.rounds):
                for mine in ((True, False) if i % 2 == 0 else (False, True)):
                    times[mine].append(one_pass(xs, mine, shape_times[mine]))
            ours, theirs = statistics.median(times[True]), statistics.median(times[False])
            ratio = statistics.median(t / o for o, t in zip(times[True], times[False],
                                                              strict=True))
            print(f"| {rows} | {ours:.1f} ({min(times[True]):.1f}) | {theirs:.1f} "
                  f"({min(times[False]):.1f}) | {flops / ours / 1e6:.0f} | "
                  f"{flops / theirs / 1e6:.0f} | {theirs / ours:.2f}x | {ratio:.2f}x |",
                  flush=True)
            if args.by_shape:
                for k, n in kinds:
                    a = statistics.median(shape_times[True][k, n]) * 1e3
                    b = statistics.median(shape_times[False][k, n]) * 1e3
                    print(f"| {rows}, [{k}, {n}] x{shapes.count((k, n))} | {a:.2f} | {b:.2f} | "
                          f"| | {b / a:.2f}x | |")
    if args.engine_prompt_len:
        _engine_prefill(args.model, args.engine_prompt_len, args.rounds, args.dtype)
    return 0

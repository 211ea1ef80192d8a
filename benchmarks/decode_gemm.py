"""The dense projections of a decode step on CPU: the native panel GEMM
(kernels/native/gemm.c) against oneDNN's prepacked inner product and F.linear.

Weights are those of a whole model (`--model`'s linears: qkv, o, gate_up,
down per layer, then lm_head), random, so a pass streams them from memory
as a decode step does, not from cache. For each row count M the table gives
the median and min of `--repeats` passes over every weight, the GB/s of
weight read they reach, and the bound: the weight bytes over the read
bandwidth of this machine measured in the same run
(`benchmarks.engine_breakdown.read_bandwidth_gb_s`).
"""

from __future__ import annotations

import argparse
import statistics
import time

HELP = ("Decode projections on CPU: the native panel GEMM against oneDNN prepacked and "
        "F.linear, per batch size, beside the weight-read bound.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base",
                        help="model directory, or 'tiny' / 'base' (its shapes only)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64",
                        help="comma-separated row counts (decode batch sizes)")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--no-f-linear", action="store_true", help="skip F.linear (slowest)")


def _shapes(model: str) -> list[tuple[int, int]]:
    """(in, out) of every dense projection of the model, in forward order."""
    from engine.model_config import ModelConfig
    from engine.model_source import resolve_model

    model_dir = resolve_model(model)
    c = ModelConfig.from_pretrained(model_dir)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = [(c.hidden_size, q + 2 * kv), (q, c.hidden_size),
             (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size)]
    return layer * c.num_hidden_layers + [(c.hidden_size, c.vocab_size)]


def main(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from benchmarks.engine_breakdown import read_bandwidth_gb_s
    from kernels import native

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not native.gemm_available():
        print("native GEMM unavailable here (no C compiler, or no AVX2 + FMA)")
        return 1
    shapes = _shapes(args.model)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) for k, n in shapes]
    panels = [native.pack_panels(w) for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    total = sum(w.numel() * 4 for w in weights)
    bandwidth = read_bandwidth_gb_s()
    bound_ms = total / (bandwidth * 1e9) * 1e3
    print(f"model {args.model}: {len(shapes)} projections, {total / 1e6:.0f} MB float32, "
          f"torch threads {torch.get_num_threads()}, read bandwidth {bandwidth:.1f} GB/s, "
          f"bound {bound_ms:.1f} ms per pass")
    print("| rows | native ms (min) | oneDNN ms (min) | F.linear ms (min) | native GB/s | "
          "native / bound | oneDNN / native |")
    print("|---:|---:|---:|---:|---:|---:|---:|")

    def timed(fn) -> tuple[float, float]:
        fn()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), min(times)

    def passes(xs: dict[int, torch.Tensor]) -> tuple[tuple[float, float], ...]:
        mine = timed(lambda: [native.gemm_panels(xs[k], p, n)
                              for (k, n), p in zip(shapes, panels, strict=True)])
        onednn = timed(lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")
                                for (k, _), p in zip(shapes, packed, strict=True)])
        plain = (float("nan"), float("nan")) if args.no_f_linear else timed(
            lambda: [F.linear(xs[k], w) for (k, _), w in zip(shapes, weights, strict=True)])
        return mine, onednn, plain

    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            mine, onednn, plain = passes(
                {k: torch.randn(rows, k, generator=g) for k in {k for k, _ in shapes}})
            print(f"| {rows} | {mine[0]:.1f} ({mine[1]:.1f}) | {onednn[0]:.1f} ({onednn[1]:.1f}) "
                  f"| {plain[0]:.1f} ({plain[1]:.1f}) | {total / mine[0] / 1e6:.1f} | "
                  f"{mine[0] / bound_ms:.2f}x | {onednn[0] / mine[0]:.2f}x |", flush=True)
    return 0

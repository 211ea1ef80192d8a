"""`pdserve bench prefill-split`: what one prompt split across the prefill
and the decode pod would give (docs/architecture.md, "One prompt on
both pods").

Why: with equal cores, the colocated baseline computes a prompt on two
cores and a prefill pod on one, so at low load disaggregated TTFT is ~2x
colocated's (docs/benchmarks.md, "Serving"). Split at token s, the prefill
pod would compute the head [0, s) and stream each layer's KV as it does
now; the decode pod would compute the tail [s, n) layer by layer, each layer
once the head's KV of that layer has arrived. Its time to first token is
then about the longer of the two parts, plus the one layer the tail trails
the head by.

Measured here in one process, on the engine alone, with the same prompts:

* baseline — the whole prompt on `--threads` threads (2 on this machine:
  the colocated pod on both cores);
* one thread — the whole prompt, the head alone, and the tail over the head
  cached (the prefix cache maps the head in; whole blocks, so s is rounded
  down to a block);
* estimate — max(head, tail) + tail / layers, against the baseline.

The estimate leaves out the transfer (it overlaps the compute: each layer's
KV is on the wire while the next computes) and the router's two calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

HELP = ("One prompt split across two pods: the head and the tail on one thread each, "
        "against the whole prompt on two (the estimate for a cross-pod split prefill).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="base",
                        help="model dir, .gguf file or name: smollm2-135m-instruct, tiny, base")
    parser.add_argument("--prompt-lens", default="512,1024")
    parser.add_argument("--split", type=float, default=0.5,
                        help="the head's share of the prompt (default 0.5)")
    parser.add_argument("--threads", type=int, default=2,
                        help="the baseline's torch threads (default 2: both cores here)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)


def _ttft(engine, prompt: list[int]) -> float:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.generate([prompt], params)
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> int:
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_source import resolve_model

    lens = [int(n) for n in args.prompt_lens.split(",")]
    if not 0 < args.split < 1 or min(lens) < 2 * args.block_size or args.repeats < 1:
        raise SystemExit("--split must be in (0, 1), every prompt length at least two blocks "
                         f"(2 x {args.block_size}), --repeats >= 1")
    model_dir = str(resolve_model(args.model))
    biggest = max(lens)
    engine = LLMEngine(EngineConfig(
        model_dir=model_dir, block_size=args.block_size,
        num_blocks=4 * -(-biggest // args.block_size) + 8,
        max_num_batched_tokens=biggest, enable_prefix_caching=True))
    layers = engine.model_config.num_hidden_layers
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def fresh(n: int) -> list[int]:  # a prompt the prefix cache has never seen
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    torch.set_num_threads(args.threads)
    _ttft(engine, fresh(min(lens)))  # warm-up
    print(f"model {model_dir} ({layers} layers), baseline {args.threads} threads, "
          f"split at {args.split:g} of the prompt (whole blocks of {args.block_size}), "
          f"{args.repeats} repeats, medians in ms")
    print("| prompt | baseline, whole | 1 thread: whole | head | tail over the cached head "
          "| split estimate | estimate / baseline | 1 thread whole / baseline |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in lens:
        s = int(n * args.split) // args.block_size * args.block_size
        base, whole, head, tail = [], [], [], []
        for _ in range(args.repeats):
            torch.set_num_threads(args.threads)
            base.append(_ttft(engine, fresh(n)))
            torch.set_num_threads(1)
            whole.append(_ttft(engine, fresh(n)))
            prompt = fresh(n)
            head.append(_ttft(engine, prompt[:s]))  # leaves [0, s) in the prefix cache
            hits = engine.stats().prefix_cache_hits  # in blocks
            tail.append(_ttft(engine, prompt))  # computes [s, n) over it
            if engine.stats().prefix_cache_hits - hits != s // args.block_size:
                raise SystemExit(f"the tail of a {n}-token prompt did not find its {s}-token "
                                 "head in the prefix cache: the estimate would time the whole")
        b, w, h, t = (statistics.median(x) * 1e3 for x in (base, whole, head, tail))
        estimate = max(h, t) + t / layers
        print(f"| {n} (head {s}) | {b:.0f} | {w:.0f} | {h:.0f} | {t:.0f} | {estimate:.0f} | "
              f"{estimate / b:.2f}x | {w / b:.2f}x |")
    return 0

"""The gap between a request's first token and its second, against the
median inter-token latency, as a client of a running OpenAI endpoint sees it.

On a P/D pair token 0 comes from the prefill pod and token 1 from the
decode pod, which first needs the KV's last layers, END, the injection and a
commit into its batch: any step the decode pod wastes there shows as a gap
longer than the usual ITL. Run against `pdserve up` (or any endpoint):

    pdserve up --model base &        # 1 prefill + 1 decode
    pdserve bench first-gap --url http://127.0.0.1:8000 --requests 12

Requests go one after another at `--concurrency` (1 by default: the gap of
an otherwise idle pair) and, with `--background N`, while N long requests
keep the decode pod stepping, so token 1 has to join a running batch.
Uses benchmarks/serve_client.py (logprobs count the tokens per chunk).
"""

from __future__ import annotations

import argparse
import json
import threading
import urllib.request

from benchmarks.serve_client import LoadSpec, percentile, random_prompts, run_load


def _model(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as reply:
        return json.load(reply)["data"][0]["id"]


def measure(url: str, *, requests: int, prompt_len: int, max_tokens: int, concurrency: int,
            background: int, seed: int) -> dict:
    """Token-0-to-token-1 gap and ITL (excluding that gap) over `requests` runs, in ms."""
    model = _model(url)
    vocab = 1000  # ids below the built-in models' vocabulary; any real model has more
    for i in range(background):
        # long requests that keep the decode pod busy while the measured ones arrive
        spec = LoadSpec(max_tokens=2000, seed=seed + 1000 + i)
        prompts = random_prompts(1, 16, vocab, seed=seed + 1000 + i)
        # daemon threads: they end with the process, and the router cancels their requests
        threading.Thread(target=lambda p=prompts, s=spec: run_load(url, model, p, s),
                         daemon=True).start()
    prompts = random_prompts(requests, prompt_len, vocab, seed=seed)
    result = run_load(url, model, prompts, LoadSpec(max_tokens=max_tokens,
                                                    concurrency=concurrency, seed=seed))
    gaps, itls = [], []
    for record in result["requests"]:
        if record["error"] or len(record["itl_s"]) < 2:
            continue
        gaps.append(record["itl_s"][0] * 1e3)
        itls.extend(g * 1e3 for g in record["itl_s"][1:])
    if not gaps:
        raise RuntimeError(f"no request finished with >= 3 tokens: {result['requests'][:1]}")
    gap_p50, itl_p50 = percentile(gaps, 50), percentile(itls, 50)
    return {"requests": len(gaps), "gap_ms_p50": round(gap_p50, 2),
            "gap_ms_max": round(max(gaps), 2), "itl_ms_p50": round(itl_p50, 2),
            "gap_over_itl_p50": round(gap_p50 / itl_p50, 2),
            "ttft_ms_p50": result["ttft_ms"]["p50"]}


HELP = ("Token-0-to-token-1 gap of a running endpoint against its median inter-token "
        "latency (the decode pod's join of a transferred request).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--background", type=int, default=0,
                        help="long requests decoding beside the measured ones")
    parser.add_argument("--seed", type=int, default=0,
                        help="prompts' seed: use a fresh one per run (the prefix cache keeps "
                             "earlier prompts)")


def main(args: argparse.Namespace) -> int:
    if args.max_tokens < 3 or args.requests < 1:
        raise SystemExit(f"--max-tokens must be >= 3 (got {args.max_tokens}) and --requests "
                         f">= 1 (got {args.requests}): a gap needs tokens 0, 1 and 2")
    print(json.dumps(measure(args.url, requests=args.requests, prompt_len=args.prompt_len,
                             max_tokens=args.max_tokens, concurrency=args.concurrency,
                             background=args.background, seed=args.seed)))
    return 0

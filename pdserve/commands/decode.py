"""`pdserve decode`: run a decode pod (see decode_service/servicer.py)."""

from __future__ import annotations

import argparse
import asyncio

HELP = "Run a decode pod: receives KV from prefill pods, injects it, and decodes."

# A decode pod's --mixed-prefill-tokens per device: the prompts it computes
# itself (the router's idle side) stall its running batch in chunks of this
# many tokens. On CPU 64, ~0.15 s of one core for the built-in base model:
# with 128 (~0.3 s) those chunks made the heavy mix's ITL p99 at 0.4 req/s
# (benchmarks/results/disagg-2026-11-27-heavy04-n96/README.md, "heavy-0.4 over
# 96 requests, and smaller chunks on the decode pod"). On CUDA a chunk costs a
# decode step little, and 128 stays until measured there.
DECODE_MIXED_PREFILL_TOKENS = {"cpu": 64, "cuda": 128}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve.commands._pod_flags import add_engine_arguments, add_server_arguments
    from pod.config import parse_size

    # Prompt work a decode pod takes (local prefill, the idle side, a split
    # prompt's tail) must not stretch its streams' token gaps past 1.5 plain
    # steps: disaggregation's point (docs/engine.md, ITL budget).
    add_engine_arguments(parser, block_size=128, prefix_cache_default=True,
                         mixed_prefill_default=DECODE_MIXED_PREFILL_TOKENS,
                         itl_budget_default="auto")
    add_server_arguments(parser, port=50061, metrics_port=9102)
    g = parser.add_argument_group("kv transfer")
    g.add_argument("--kv-port", type=int, default=50062,
                   help="Port prefill pods push KV to, 0 = any free port (default 50062).")
    g.add_argument("--kv-transport", choices=("tcp", "grpc"), default="tcp")
    g.add_argument("--landing-memory", type=parse_size, default=parse_size("1GiB"),
                   metavar="SIZE", help="Budget of KV in flight (landing buffers, default 1GiB).")
    g.add_argument("--transfer-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="How long one KV transfer may take from the prefill pod's first "
                        "frame (BEGIN) to its last (default 30).")
    g.add_argument("--reservation-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="How long a reserved request waits for a prefill pod to begin "
                        "sending its KV, e.g. while its prefill is queued (default 600).")
    g.add_argument("--kv-max-connections", type=int, default=256, metavar="N",
                   help="Sender connections the TCP KV port serves at once; more are refused "
                        "and counted (a prefill pod keeps 4 per decode pod; default 256).")
    g.add_argument("--kv-frame-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="How long one KV frame may take from its first byte to its last; a "
                        "sender trickling bytes is cut off (default 10).")
    g.add_argument("--kv-auth-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="A new TCP KV connection must send a BEGIN with a valid ticket within "
                        "this, or be closed and counted; until then it costs no thread or "
                        "connection slot (default 5).")
    g.add_argument("--kv-max-pending", type=int, default=256, metavar="N",
                   help="TCP KV connections waiting to authenticate at once; over it the "
                        "oldest is dropped (default 256).")
    g.add_argument("--kv-max-pending-per-peer", type=int, default=64, metavar="N",
                   help="... and from one address; over it new ones are closed (a prefill "
                        "pod at TP=a opens 4a at once; default 64).")
    g.add_argument("--join-wait", type=float, default=0.5, metavar="FRACTION",
                   help="How long, as a fraction of a step (0-1), the engine may hold a "
                        "step's start for a transfer expected to complete by then, so the "
                        "request's second token comes one step after its first, not 1.5 on "
                        "average; once per request, 0 = never (default 0.5).")


def main(args: argparse.Namespace) -> int:
    from decode_service.config import DecodeConfig
    from decode_service.server import run_decode_pod
    from pdserve.commands._model_arg import resolve_model_arg
    from pdserve.commands._pod_flags import (
        apply_placement,
        engine_config_from_args,
        server_config_from_args,
        setup_logging,
        setup_tracing,
    )

    setup_logging(args.log_level)
    setup_tracing(args, "decode")
    apply_placement(args)
    resolve_model_arg(args, "decode")
    config = DecodeConfig(
        engine=engine_config_from_args(args), server=server_config_from_args(args),
        kv_port=args.kv_port, kv_transport=args.kv_transport,
        landing_memory=args.landing_memory, transfer_timeout_s=args.transfer_timeout,
        reservation_timeout_s=args.reservation_timeout,
        kv_max_connections=args.kv_max_connections, kv_frame_timeout_s=args.kv_frame_timeout,
        kv_auth_timeout_s=args.kv_auth_timeout, kv_max_pending=args.kv_max_pending,
        kv_max_pending_per_peer=args.kv_max_pending_per_peer,
        join_wait=args.join_wait,
    )
    return asyncio.run(run_decode_pod(config))

"""`pdserve prefill`: run a prefill pod (see prefill_service/servicer.py)."""

from __future__ import annotations

import argparse
import asyncio

HELP = "Run a prefill pod: computes prompts and streams their KV to decode pods."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve.commands._pod_flags import add_engine_arguments, add_server_arguments

    add_engine_arguments(parser, block_size=16, prefix_cache_default=True)
    add_server_arguments(parser, port=50051, metrics_port=9101)
    parser.add_argument("--kv-streams", type=int, default=4,
                        help="Parallel connections per KV transfer (default 4).")


def main(args: argparse.Namespace) -> int:
    from pdserve.commands._model_arg import resolve_model_arg
    from pdserve.commands._pod_flags import (
        apply_placement,
        engine_config_from_args,
        server_config_from_args,
        setup_logging,
        setup_tracing,
    )
    from prefill_service.config import PrefillConfig
    from prefill_service.server import run_prefill_pod

    setup_logging(args.log_level)
    setup_tracing(args, "prefill")
    apply_placement(args)
    resolve_model_arg(args, "prefill")
    config = PrefillConfig(engine=engine_config_from_args(args),
                           server=server_config_from_args(args), kv_streams=args.kv_streams)
    return asyncio.run(run_prefill_pod(config))

"""`pdserve serve`: run a colocated pod, prefill and decode in one engine
behind the same `Decode.Generate` (the baseline of every comparison)."""

from __future__ import annotations

import argparse
import asyncio

HELP = "Run a colocated pod: prefill and decode in one process, no KV transfer."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve.commands._pod_flags import add_engine_arguments, add_server_arguments

    add_engine_arguments(parser, block_size=16, prefix_cache_default=True)
    add_server_arguments(parser, port=50071, metrics_port=9103)


def main(args: argparse.Namespace) -> int:
    from decode_service.config import ColocatedConfig
    from decode_service.server import run_colocated_pod
    from pdserve.commands._model_arg import resolve_model_arg
    from pdserve.commands._pod_flags import (
        apply_placement,
        engine_config_from_args,
        server_config_from_args,
        setup_logging,
        setup_tracing,
    )

    setup_logging(args.log_level)
    setup_tracing(args, "colocated")
    apply_placement(args)
    resolve_model_arg(args, "serve")
    config = ColocatedConfig(engine=engine_config_from_args(args),
                             server=server_config_from_args(args))
    return asyncio.run(run_colocated_pod(config))

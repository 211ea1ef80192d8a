"""`--model` resolved once at a role's start, before its config is built.

Every role (prefill, decode, serve, router) calls `resolve_model_arg` first
in its `main`, so the config builders stay pure (no conversion, no file
reads) and their tests need no model on disk.
"""

from __future__ import annotations

import argparse
import sys


def resolve_model_arg(args: argparse.Namespace, command: str) -> None:
    """Replace `args.model` by the model directory it names (a GGUF file or a
    model name is converted into the model cache on first use); exit 2 with
    the reason when it names nothing usable."""
    from engine.model_source import resolve_model

    try:
        args.model = str(resolve_model(args.model, say=lambda text: print(text, flush=True)))
    except ValueError as exc:
        print(f"pdserve {command}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None

"""`pdserve` console script: one subcommand per role or tool.

Each subcommand lives in its own module, imported only when chosen, so
`pdserve router` never imports torch and `pdserve --help` is instant. A
command module defines:

    HELP: str                                   one line for `pdserve --help`
    def add_arguments(parser: argparse.ArgumentParser) -> None
    def main(args: argparse.Namespace) -> int   exit status

Command modules parse flags into their service's validated config dataclass;
the services themselves never see argparse.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module implementing it (see module docstring for the protocol)
COMMANDS: dict[str, str] = {
    "up": "pdserve.commands.up",
    "router": "pdserve.commands.router",
    "prefill": "pdserve.commands.prefill",
    "decode": "pdserve.commands.decode",
    "serve": "pdserve.commands.serve",
    "make-model": "pdserve.commands.make_model",
    "generate": "pdserve.commands.generate",
    "bench": "pdserve.commands.bench",
    "sim": "pdserve.commands.sim",
    "plan": "pdserve.commands.plan",
    "trace": "pdserve.commands.trace",
}


def _command_help(module_name: str) -> str:
    try:
        return getattr(importlib.import_module(module_name), "HELP", "")
    except ImportError as exc:  # a command whose module is missing still lists
        return f"(unavailable: {exc})"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode disaggregated LLM serving."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, module_name in COMMANDS.items():
        if name == chosen:
            module = importlib.import_module(module_name)
            cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
            module.add_arguments(cmd)
            cmd.set_defaults(_module=module)
        else:
            sub.add_parser(name, help=_command_help(module_name) if chosen is None else "")
    return parser


# processes that run an engine: their OpenMP spin is set before torch loads
POD_COMMANDS = ("prefill", "decode", "serve")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if next((a for a in argv if not a.startswith("-")), None) in POD_COMMANDS:
        from pdserve.commands._cpus import default_pod_spin

        default_pod_spin()
    args = build_parser(argv).parse_args(argv)
    return int(args._module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

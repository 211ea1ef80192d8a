"""docs/defaults.md's table is what the commands parse: a default that
changes without its row (or a row whose flag is gone) fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pdserve.cli import build_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "defaults.md"
ROW = re.compile(r"^\| (\w[\w-]*) \| `(--[\w-]+)` \| `(\w+)` \| `(.+?)` \| .+ \|$")
REQUIRED = {"decode": ["--model", "m"], "prefill": ["--model", "m"], "serve": ["--model", "m"],
            "router": ["--model", "m"]}


def _rows() -> list[tuple[str, str, str, object]]:
    rows = []
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            command, flag, dest, value = match.groups()
            rows.append((command, flag, dest, ast.literal_eval(value)))
    return rows


def test_the_table_is_there_and_covers_the_disaggregation_defaults() -> None:
    rows = _rows()
    named = {(command, flag) for command, flag, _, _ in rows}
    for must in [("decode", "--itl-budget-ms"), ("decode", "--mixed-prefill-tokens"),
                 ("router", "--routing-policy"), ("router", "--split-prefill-min-tokens"),
                 ("router", "--local-prefill-max-tokens")]:
        assert must in named, f"docs/defaults.md has no row for {must}"


@pytest.mark.parametrize(("command", "flag", "dest", "value"), _rows(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_each_documented_default_is_the_parsed_one(command: str, flag: str, dest: str,
                                                   value: object) -> None:
    parser = build_parser([command])
    assert flag in _flags(parser, command), f"pdserve {command} has no flag {flag}"
    args = parser.parse_args([command, *REQUIRED.get(command, [])])
    assert getattr(args, dest) == value, (
        f"pdserve {command} {flag}: parsed default {getattr(args, dest)!r}, "
        f"docs/defaults.md says {value!r}: change both, with the reason")


def _flags(parser, command: str) -> set[str]:
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {option for action in sub._actions for option in action.option_strings}

"""`pdserve make-model` (pdserve/commands/make_model.py): flag errors exit 2.
The checkpoint itself is tested in tests/engine/test_make_model.py."""

from __future__ import annotations

from pathlib import Path

from pdserve.cli import main


def test_cli_reports_errors(tmp_path: Path) -> None:
    assert main(["make-model", str(tmp_path / "m"), "--sliding-window", "8"]) == 2

"""`--model` resolved at a role's start (pdserve/commands/_model_arg.py)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.commands._model_arg import resolve_model_arg


def test_a_directory_stays_and_nothing_usable_exits_2(tiny_model_dir, tmp_path, capsys):
    args = argparse.Namespace(model=str(tiny_model_dir))
    resolve_model_arg(args, "decode")
    assert args.model == str(tiny_model_dir)
    args = argparse.Namespace(model=str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit) as info:
        resolve_model_arg(args, "router")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve router: --model {tmp_path / 'nowhere'}: not a model "
                          "directory, a .gguf file or a known model name")

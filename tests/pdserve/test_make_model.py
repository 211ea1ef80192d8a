"""`pdserve make-model` (pdserve/commands/make_model.py): flag errors exit 2.
The checkpoint itself is tested in tests/engine/test_make_model.py."""

from __future__ import annotations

from pathlib import Path

from pdserve.cli import main


def test_cli_reports_errors(tmp_path: Path) -> None:
    assert main(["make-model", str(tmp_path / "m"), "--sliding-window", "8"]) == 2


def test_from_gguf_writes_a_directory_transformers_loads(tmp_path: Path, capsys) -> None:
    """The tiny model written as GGUF (F32, q/k rows in llama.cpp's order)
    and converted back by the command: transformers loads the result and
    computes the original checkpoint's logits exactly."""
    import json

    import pytest

    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.numpy import load_file

    from engine.make_model import make_model
    from tests.engine.gguf.gguf_files import write_gguf

    original = make_model(tmp_path / "hf", size="tiny", seed=5)
    source = write_gguf(tmp_path / "tiny.gguf", json.loads((original / "config.json").read_text()),
                        load_file(str(original / "model.safetensors")))
    assert main(["make-model", str(tmp_path / "out"), "--from-gguf", str(source)]) == 0
    assert f"converted {source} to {tmp_path / 'out'} in " in capsys.readouterr().out
    ids = torch.tensor([[3, 17, 99, 250, 7, 42]])
    with torch.inference_mode():
        want = transformers.AutoModelForCausalLM.from_pretrained(original).eval()(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(ids).logits
    assert torch.equal(got, want)


def test_from_gguf_reports_a_bad_file(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    assert main(["make-model", str(tmp_path / "out"), "--from-gguf", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve make-model: {bad}: not a readable GGUF file")
    assert not (tmp_path / "out").exists()

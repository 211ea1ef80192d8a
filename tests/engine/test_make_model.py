"""engine.make_model and `pdserve make-model`: deterministic, complete,
loadable checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.loader import load_model
from engine.make_model import default_model_dir, ensure_model, make_model

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"]


def _contents(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


@pytest.mark.timeout(120)
def test_same_seed_is_byte_identical_across_processes(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    # a fresh interpreter: no state shared with the fixture's run
    out = tmp_path / "again"
    subprocess.run([sys.executable, "-m", "pdserve", "make-model", str(out), "--seed", "0"],
                   check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == FILES
    assert _contents(out) == _contents(tiny_model_dir)


def test_other_seed_changes_only_the_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = _contents(make_model(tmp_path / "s1", seed=1))
    same = _contents(tiny_model_dir)
    assert [n for n in FILES if other[n] != same[n]] == ["model.safetensors"]


def test_config_describes_the_tiny_model(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size",
                                   "vocab_size", "bos_token_id", "eos_token_id")} == {
        "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
        "vocab_size": 1100, "bos_token_id": 0, "eos_token_id": [1, 4]}
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 4]


def test_refuses_non_empty_directory(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="is not empty"):
        make_model(tiny_model_dir)


@pytest.mark.parametrize("kwargs, message", [
    ({"size": "huge"}, "size must be one of tiny, base, got 'huge'"),
    ({"sliding_window": 16}, "sliding_window needs one of MistralForCausalLM, "
                             "MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM"),
    ({"architecture": "GPT2"}, "architecture must be one of"),
    ({"num_shards": 0}, "num_shards must be >= 1, got 0"),
])
def test_bad_options(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_model(tmp_path / "m", **kwargs)


def test_ensure_model_creates_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    target = default_model_dir("tiny")
    assert target == tmp_path / "home" / "models" / "pdserve-tiny"
    assert ensure_model("tiny") == target
    first = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("tiny") == target
    assert (target / "model.safetensors").stat().st_mtime_ns == first
    # no temporary directories left behind
    assert [p.name for p in target.parent.iterdir()] == ["pdserve-tiny"]
    model, config = load_model(target)
    assert config.num_hidden_layers == 2


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Phi3ForCausalLM",
                                          "MixtralForCausalLM"])
def test_new_architectures_load_and_match_the_reference(tmp_path: Path, architecture) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.reference import reference_greedy
    from engine.sampling_params import SamplingParams

    path = make_model(tmp_path / "m", size="tiny", seed=2, architecture=architecture,
                      sliding_window=None if architecture == "Qwen3ForCausalLM" else 24)
    engine = LLMEngine(EngineConfig(model_dir=str(path), dtype="float32", num_blocks=16))
    prompt = list(range(10, 50))
    (result,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                         ignore_eos=True))
    assert list(result.token_ids) == reference_greedy(engine.model, prompt, 8)

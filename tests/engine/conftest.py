"""Engine-core fixtures: the tiny model (built once by `tiny_model_dir` in
tests/conftest.py), loaded once for the reference, and an engine factory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.model import LlamaForCausalLM


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir: Path) -> LlamaForCausalLM:
    model, _ = load_model(tiny_model_dir, dtype="float32", device="cpu")
    return model


@pytest.fixture
def make_engine(tiny_model_dir: Path) -> Callable[..., LLMEngine]:
    """`make_engine(num_blocks=..., block_size=..., ...)`: a float32 CPU engine."""

    def make(**overrides) -> LLMEngine:
        fields = {"model_dir": str(tiny_model_dir), "dtype": "float32", "num_blocks": 64}
        fields.update(overrides)
        hook = fields.pop("layer_kv_hook", None)
        return LLMEngine(EngineConfig(**fields), layer_kv_hook=hook)

    return make


@pytest.fixture(scope="session")
def sliding_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 20-token sliding window (Mistral convention)."""
    from engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-sliding", size="tiny", seed=1,
                      architecture="MistralForCausalLM",
                      sliding_window=20)

"""The decoder class of each supported architecture (`model_class`).

Llama, Mistral, Qwen2 and Phi-3 are one module (engine/model.py: Phi-3
differs only in its checkpoint layout and RoPE, handled by the loader and
the RoPE table); Qwen3 and Mixtral subclass it with their attention or MLP.
"""

from __future__ import annotations

from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The module class that runs `config.architecture` (a supported one:
    ModelConfig refuses the others)."""
    return _CLASSES.get(config.architecture, LlamaForCausalLM)


__all__ = ["MixtralForCausalLM", "Qwen3ForCausalLM", "model_class"]

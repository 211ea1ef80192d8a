"""`model_class`: the decoder class that runs each supported architecture.

Llama, Mistral, Qwen2 and Phi-3 are one module (engine/model.py: Phi-3
differs only in its checkpoint layout and RoPE, handled by the loader and
the RoPE table); Qwen3 and Mixtral subclass it with their attention or MLP;
Gemma 2/3 are their own module (engine/models/gemma.py). Kept out of the
package's __init__: engine.model_config imports engine.models.gemma_config.
"""


from __future__ import annotations

from torch import nn

from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.models.gemma import GemmaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

_CLASSES: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The module class that runs `config.architecture` (a supported one:
    ModelConfig refuses the others)."""
    if config.gemma is not None:
        return GemmaForCausalLM
    return _CLASSES.get(config.architecture, LlamaForCausalLM)


__all__ = ["GemmaForCausalLM", "MixtralForCausalLM", "Qwen3ForCausalLM", "model_class"]

"""`LayerAttention`: how one decoder layer's attention scores its keys.

Built once per model by `layer_attention(config)` (the model runner and the
dense reference call it) and handed to the attention contexts, which pick
layer `i`'s entry at each `attend` / `attend_qkv` call. Llama-family models
have one entry repeated (scale head_dim ** -0.5, the model's sliding window
or none, no soft-cap), so their kernels are called exactly as before; Gemma
varies the window per layer and adds soft-capping
(`engine.models.gemma_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """scale multiplies q.k; a key is visible to the query at position p when
    p - sliding_window < j <= p (None: all j <= p); softcap C turns each
    scaled score s into C * tanh(s / C) before the softmax (None: off)."""

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or None, got {self.sliding_window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")


def layer_attention(config: ModelConfig) -> tuple[LayerAttention, ...]:
    """One entry per decoder layer, in layer order."""
    gemma = config.gemma
    if gemma is None:
        return (LayerAttention(config.head_dim ** -0.5, config.sliding_window),
                ) * config.num_hidden_layers
    return tuple(
        LayerAttention(gemma.attention_scale,
                       gemma.sliding_window if gemma.is_sliding(i) else None,
                       gemma.attn_logit_softcapping)
        for i in range(config.num_hidden_layers))

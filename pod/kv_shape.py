"""`KVShape`: the served model's per-token KV shape, which both ends of a KV
transfer turn into a `KVLayout` for each request (the prefill pod to send,
the decode pod to reserve and receive). Built once per pod at start."""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig
from kv_transfer.base import KVLayout


@dataclass(frozen=True, slots=True)
class KVShape:
    """Per-token KV shape of the served model: what a `KVLayout` needs besides the length."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def layout(self, num_tokens: int, token_offset: int = 0) -> KVLayout:
        """The layout of context tokens `[token_offset, token_offset + num_tokens)`."""
        return KVLayout(self.num_layers, num_tokens, self.num_kv_heads, self.head_dim, self.dtype,
                        token_offset)

    def bytes_of(self, num_tokens: int) -> int:
        """KV bytes of `num_tokens` tokens over all layers, in transfer layout."""
        return num_tokens * self.layout(1).total_bytes


def kv_shape_of(model_dir: str, dtype: str) -> KVShape:
    """The KV shape of the model in `model_dir` stored as `dtype`."""
    model = ModelConfig.from_pretrained(model_dir)
    return KVShape(model.num_hidden_layers, model.num_key_value_heads, model.head_dim, dtype)

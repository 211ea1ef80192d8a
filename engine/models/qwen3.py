"""Qwen3: the Llama decoder with an RMSNorm over each q and k head
(`q_norm`, `k_norm`, weights [head_dim]) between the projection and RoPE.

The norms run on the qkv projection's output before it goes on, so both
attention paths take them: the split path (prefill) and the fused decode
call (`AttentionContext.attend_qkv`: RoPE, K/V write and attention) see
already normalised q and k, and no kernel needs to know about them. Under
tensor parallelism each rank normalises its own heads with the same
(replicated) norm weights.
"""

from __future__ import annotations

import torch

from engine.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, RMSNorm
from engine.model_config import ModelConfig
from engine.parallel.group import TPGroup
from kernels.dispatch import Backend


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype: torch.dtype,
                 device: torch.device | str, kernel_backend: Backend,
                 tp: TPGroup | None = None) -> None:
        super().__init__(config, layer_idx, dtype=dtype, device=device,
                         kernel_backend=kernel_backend, tp=tp)
        kw = dict(dtype=dtype, device=device, kernel_backend=kernel_backend)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **kw)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **kw)

    def project_qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        """qkv with every q and k head RMS-normalised (v untouched)."""
        qkv = self.qkv_proj(hidden)
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [N * heads, D] rows: the norm kernels take 2-D input.
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.q_size)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.kv_size)
        return torch.cat((q, k, v), dim=-1)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Parameter names as `LlamaForCausalLM`'s, plus
    `model.layers.{i}.self_attn.{q,k}_norm.weight` (HF's names)."""

    decoder_layer_cls = Qwen3DecoderLayer

"""Gemma 2 and Gemma 3 (text) decoders in plain torch.

Built by `engine.loader.load_model` for a config whose `gemma` is set, then
used exactly like `engine.model.LlamaForCausalLM` (same constructor,
`forward`, `compute_logits`, `config`, `kernel_backend`, `dtype`, `device`):
the engine loop thread calls `forward` once per step with the step's
`AttentionContext`, which applies each layer's `LayerAttention` (scale
`query_pre_attn_scalar ** -0.5`, the sliding window on sliding layers, Gemma
2's attention logit soft-cap; `engine.layer_attention`).

What differs from Llama, each as Hugging Face's Gemma computes it:
- RMSNorm scales by (1 + weight): the checkpoint stores the offset from 1.
  The effective weight is computed once, at the first call (the loader has
  filled the parameter by then), in the model dtype.
- Embeddings are multiplied by sqrt(hidden_size) rounded to the model dtype.
- The MLP is GeGLU: down(gelu_tanh(gate(x)) * up(x)).
- Each sub-block is normalised on both sides: input -> attention ->
  post_attention_layernorm -> + residual -> pre_feedforward_layernorm ->
  MLP -> post_feedforward_layernorm -> + residual. The residual adds are
  fused into the next norm, as in `engine.model`.
- Gemma 3 RMS-normalises every query and key head (q_norm, k_norm) before
  RoPE, and its sliding layers use their own RoPE base (rope_local_theta).
  The norms are applied to the qkv projection's output in place, so a
  pure-decode step still takes the context's fused `attend_qkv`.
- Final logits are soft-capped (final_logit_softcapping) in float32.

Under tensor parallelism it shards as `engine.model` does (heads, the MLP's
intermediate dim, the vocabulary; engine/parallel/shard.py): the scale
multiplies the summed embedding, each rank soft-caps its own logits
(elementwise, so before or after the gather is the same), the q/k norms
and the four layer norms are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_context import AttentionContext
from engine.layers.linear import Linear
from engine.layers.parallel import embed_tokens, model_logits, row_linear, shard_of
from engine.layers.rotary import build_cos_sin_cache
from engine.model import attend_projected
from engine.model_config import ModelConfig
from engine.models.gemma_config import GemmaConfig
from engine.parallel.group import TPGroup
from kernels import dispatch as kernel_ops
from kernels import fused as fused_ops
from kernels.dispatch import Backend
from kernels.reference import soft_cap

__all__ = ["GemmaForCausalLM"]


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised: the loader overwrites every parameter.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), with the optional fused residual add
    of `engine.model.RMSNorm` (in place on x and residual)."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype,
                 device: torch.device | str, kernel_backend: Backend) -> None:
        super().__init__()
        self.weight = _empty(size, dtype=dtype, device=device)
        self.eps = eps
        self.kernel_backend = kernel_backend
        # (the parameter it was computed from, 1 + weight, the bound in-place norm)
        self._bound: tuple[torch.Tensor, torch.Tensor, fused_ops.ResidualRMSNorm] | None = None

    def _scale(self) -> tuple[torch.Tensor, fused_ops.ResidualRMSNorm]:
        bound = self._bound
        if bound is None or bound[0] is not self.weight:
            scale = (1.0 + self.weight.float()).to(self.weight.dtype)
            bound = self._bound = (self.weight, scale, fused_ops.ResidualRMSNorm(
                scale, self.eps, backend=self.kernel_backend))
        return bound[1], bound[2]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        scale, in_place = self._scale()
        if residual is None:
            return kernel_ops.rms_norm(x, scale, self.eps, backend=self.kernel_backend)
        return in_place(x, residual)


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype: torch.dtype,
                 device: torch.device | str, kernel_backend: Backend,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        gemma = config.gemma
        self.layer_idx = layer_idx
        self.kernel_backend = kernel_backend
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False,
                               dtype=dtype, device=device)
        self.o_proj = row_linear(self.q_size, config.hidden_size, tp=tp, dtype=dtype,
                                 device=device)
        self.q_norm: GemmaRMSNorm | None = None
        self.k_norm: GemmaRMSNorm | None = None
        if gemma.qk_norm:
            kw = dict(dtype=dtype, device=device, kernel_backend=kernel_backend)
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, **kw)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, **kw)

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """q_norm / k_norm over each head of qkv's q and k columns, in place."""
        num_tokens, d = qkv.shape[0], self.head_dim
        for norm, cols in ((self.q_norm, slice(0, self.q_size)),
                           (self.k_norm, slice(self.q_size, self.q_size + self.kv_size))):
            heads = qkv[:, cols].reshape(-1, d)
            qkv[:, cols] = norm(heads).view(num_tokens, -1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                cos_sin_cache: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None:
            self._norm_heads(qkv)
        return attend_projected(self, qkv, positions, cos_sin_cache, ctx)


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype,
                 device: torch.device | str, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                   bias=False, dtype=dtype, device=device)
        self.down_proj = row_linear(config.intermediate_size, config.hidden_size, tp=tp,
                                    dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype: torch.dtype,
                 device: torch.device | str, kernel_backend: Backend,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device, kernel_backend=kernel_backend)
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.is_sliding = config.gemma.is_sliding(layer_idx)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, **kw)
        self.self_attn = GemmaAttention(config, layer_idx, **kw, tp=tp)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, **kw)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, **kw)
        self.mlp = GemmaMLP(config, dtype=dtype, device=device, tp=tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, **kw)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the MLP block's normalised output, the residual stream
        before it): the next norm adds them."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, cos_sin_cache, ctx)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype,
                 device: torch.device | str, kernel_backend: Backend,
                 vocab_rows: int | None = None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _empty(vocab_rows or config.vocab_size, config.hidden_size,
                                          dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, dtype=dtype, device=device,
                              kernel_backend=kernel_backend, tp=tp)
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                 device=device, kernel_backend=kernel_backend)


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 text model; parameter names follow HF's except the
    merged `qkv_proj` / `gate_up_proj` (as `engine.model`)."""

    # Decode steps capture in CUDA graphs as Llama's do (engine/cuda_graphs.py).
    cuda_graph_blocker: str | None = None

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 kernel_backend: Backend | str = Backend.AUTO,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        if config.gemma is None:
            raise ValueError(f"{config.architecture} is not a Gemma config (config.gemma is None)")
        gemma: GemmaConfig = config.gemma
        self.config = config
        self.tp = tp
        self.shard = shard_of(config, tp)
        self.kernel_backend = Backend.parse(kernel_backend)
        self.model = GemmaModel(self.shard.local_config(config), dtype=dtype, device=device,
                                kernel_backend=self.kernel_backend,
                                vocab_rows=self.shard.vocab_shard, tp=tp)
        self.lm_head = Linear(
            config.hidden_size, self.shard.vocab_shard, bias=False, dtype=dtype, device=device,
            shared_weight=self.model.embed_tokens.weight if config.tie_word_embeddings else None)
        # HF multiplies by sqrt(hidden) rounded to the model dtype.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5).to(
            dtype=dtype, device=device), persistent=False)
        caches = {theta: build_cos_sin_cache(config.max_position_embeddings, config.head_dim,
                                             theta).to(device)
                  for theta in {gemma.rope_theta, gemma.rope_local_theta}}
        self.register_buffer("cos_sin_cache", caches[gemma.rope_theta], persistent=False)
        self.register_buffer("local_cos_sin_cache", caches[gemma.rope_local_theta],
                             persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """Final hidden states [N, hidden]; same contract as `LlamaForCausalLM.forward`."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be 1-D of equal length, got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        hidden = embed_tokens(input_ids, self.model.embed_tokens.weight, self.shard,
                              self.tp) * self.embed_scale
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            cache = self.local_cos_sin_cache if layer.is_sliding else self.cos_sin_cache
            hidden, residual = layer(positions, hidden, residual, cache, ctx)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [n, vocab] in float32, soft-capped when the config says so;
        under `tp` rank 0's gathered logits, None on the others (as
        `LlamaForCausalLM.compute_logits`)."""
        logits = soft_cap(self.lm_head(hidden).float(), self.config.gemma.final_logit_softcapping)
        return model_logits(logits, self.tp, self.config.vocab_size)

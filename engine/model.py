"""Llama-family decoder (Llama, Mistral, Qwen2, Phi-3) in plain torch; the
base of the other architectures (engine/models/: Qwen3, Mixtral).

Built by `engine.loader.load_model` (parameters are allocated uninitialised
and filled from the checkpoint), then owned by the engine loop thread, which
calls `forward` and `compute_logits` once per step. The module holds weights
only: KV storage and sequence boundaries live in the `AttentionContext` passed
to each `forward`.

Layout decisions (for speed, made at load time):
- q/k/v projections are one matmul: `qkv_proj.weight` is the row-wise
  concatenation [q_proj; k_proj; v_proj] (and the biases likewise).
- gate/up are one matmul: `gate_up_proj.weight` = [gate_proj; up_proj].
- With tied embeddings `lm_head.weight` *is* `embed_tokens.weight` (until the
  engine prepacks the linears: engine/layers/linear.py).
Under tensor parallelism (`tp`, a `TPGroup`) the module holds one rank's
shard (`shard`, engine/parallel/shard.py): layers built from the rank's
view of the config, `o_proj` and `down_proj` all-reduced
(engine/layers/parallel.py), the embedding and lm_head over its vocabulary
range. Without a group the forward is the single-device one, op for op.
RoPE, RMSNorm and SwiGLU's activation go through `kernels` with the model's
`kernel_backend` (by default Triton on CUDA, the native C kernels on CPU).

What lies between two linears is one kernel call where it can be: a CPU
decode step streams each linear's weights and so evicts everything the small
ops in between touch, making each of them cost several times its own work
(docs/kernels.md, "Fused decode ops"). So the norms work in place on the
residual stream (`x <- norm(x + residual)`, `residual <- x + residual`;
`kernels.ResidualRMSNorm`, checked once per layout),
SwiGLU's split/silu/multiply is `kernels.silu_and_mul`, and in a pure-decode
step the context takes the qkv projection's output whole
(`AttentionContext.attend_qkv`: split, RoPE, K/V write and attention in one
call).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention_context import AttentionContext
from engine.decode_layers import DecodeLayers
from engine.layers.linear import Linear
from engine.layers.parallel import embed_tokens, model_logits, row_linear, shard_of
from engine.layers.rotary import cos_sin_cache_for
from engine.model_config import ModelConfig
from engine.parallel.group import TPGroup

# Through kernels.dispatch, not the `kernels` package attribute: importing the
# submodule kernels/rms_norm.py (the Triton launcher) rebinds `kernels.rms_norm`
# from the function to that module.
from kernels import dispatch as kernel_ops
from kernels import fused as fused_ops
from kernels.dispatch import Backend

__all__ = ["AttentionContext", "LlamaForCausalLM"]


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised on purpose: the loader overwrites every parameter, and a
    # random init of a 100M-parameter model would cost seconds at startup.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (see `kernels.dispatch.rms_norm`).

    With a residual it works in place: `x` becomes the normalised sum and
    `residual` the sum itself (both are returned); the model owns both (each
    is a fresh output of the layer before)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype,
                 device: torch.device | str, kernel_backend: Backend) -> None:
        super().__init__()
        self.weight = _empty(hidden_size, dtype=dtype, device=device)
        self.eps = eps
        self.kernel_backend = kernel_backend
        # Bound at the first call with a residual (the weight is loaded by then).
        self._in_place: fused_ops.ResidualRMSNorm | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return kernel_ops.rms_norm(x, self.weight, self.eps, backend=self.kernel_backend)
        in_place = self._in_place
        if in_place is None or in_place.weight is not self.weight:
            in_place = self._in_place = fused_ops.ResidualRMSNorm(
                self.weight, self.eps, backend=self.kernel_backend)
        return in_place(x, residual)


class LlamaAttention(nn.Module):
    """`config` is this rank's view (`ShardLayout.local_config`): its heads
    only; `o_proj` is row-parallel under `tp`."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype: torch.dtype,
                 device: torch.device | str, kernel_backend: Backend,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.kernel_backend = kernel_backend
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=config.attention_bias, dtype=dtype, device=device)
        self.o_proj = row_linear(self.q_size, config.hidden_size, tp=tp, dtype=dtype,
                                 device=device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                cos_sin_cache: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return attend_projected(self, self.project_qkv(hidden), positions, cos_sin_cache, ctx)

    def project_qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, (Hq + 2 Hkv) * D] q, k, v before RoPE (subclasses add q/k norms)."""
        return self.qkv_proj(hidden)


def attend_projected(attn: nn.Module, qkv: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """Attention from a layer's projected [N, (Hq + 2 Hkv) * D] qkv to its
    o_proj output: the fused pure-decode call when the context takes it,
    else split, RoPE and `ctx.attend`. `attn` has the Llama attention's
    sizes, `layer_idx`, `kernel_backend` and `o_proj` (Gemma's does too)."""
    num_tokens = qkv.shape[0]
    out = ctx.attend_qkv(attn.layer_idx, qkv, positions, cos_sin_cache)
    if out is not None:
        return attn.o_proj(out.reshape(num_tokens, attn.q_size))
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.reshape(num_tokens, attn.num_heads, attn.head_dim)
    k = k.reshape(num_tokens, attn.num_kv_heads, attn.head_dim)
    v = v.reshape(num_tokens, attn.num_kv_heads, attn.head_dim)
    q, k = kernel_ops.rotary_embedding(positions, q, k, cos_sin_cache,
                                       backend=attn.kernel_backend)
    out = ctx.attend(attn.layer_idx, q, k, v)
    return attn.o_proj(out.reshape(num_tokens, attn.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul; of
    this rank's intermediate slice, `down_proj` row-parallel under `tp`."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype,
                 device: torch.device | str, kernel_backend: Backend,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.kernel_backend = kernel_backend
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                   bias=False, dtype=dtype, device=device)
        self.down_proj = row_linear(config.intermediate_size, config.hidden_size, tp=tp,
                                    dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x),
                                                     backend=self.kernel_backend))


class LlamaDecoderLayer(nn.Module):
    # Subclasses swap the attention or the MLP (engine/models/).
    attention_cls: type[LlamaAttention] = LlamaAttention
    mlp_cls: type[nn.Module] = LlamaMLP

    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype: torch.dtype,
                 device: torch.device | str, kernel_backend: Backend,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device, kernel_backend=kernel_backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.self_attn = self.attention_cls(config, layer_idx, **kw, tp=tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.mlp = self.mlp_cls(config, **kw, tp=tp)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        cos_sin_cache: torch.Tensor, ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the
        # previous sub-block's residual add (residual = hidden + residual).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, cos_sin_cache, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embeddings (`vocab_rows` of them: this rank's padded vocabulary
    shard), the layers of this rank's `config` view, the final norm."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype,
                 device: torch.device | str, kernel_backend: Backend,
                 layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
                 vocab_rows: int | None = None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _empty(vocab_rows or config.vocab_size, config.hidden_size,
                                          dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            layer_cls(config, i, dtype=dtype, device=device, kernel_backend=kernel_backend,
                      tp=tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device,
                            kernel_backend=kernel_backend)


class LlamaForCausalLM(nn.Module):
    """The whole model, or under `tp` this rank's shard of it (`shard`,
    engine/parallel/shard.py); parameter names follow HF's except the merged
    `qkv_proj` / `gate_up_proj` (see module docstring). `config` is the full
    model's either way."""

    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # Why decode steps of this model cannot be captured in a CUDA graph
    # (engine/cuda_graphs.py), or None.
    cuda_graph_blocker: str | None = None

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 kernel_backend: Backend | str = Backend.AUTO,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.shard = shard_of(config, tp)
        self.kernel_backend = Backend.parse(kernel_backend)
        self.model = LlamaModel(self.shard.local_config(config), dtype=dtype, device=device,
                                kernel_backend=self.kernel_backend,
                                layer_cls=self.decoder_layer_cls,
                                vocab_rows=self.shard.vocab_shard, tp=tp)
        # Tied: shared until prepacking gives lm_head its own blocked copy.
        self.lm_head = Linear(
            config.hidden_size, self.shard.vocab_shard, bias=False, dtype=dtype, device=device,
            shared_weight=self.model.embed_tokens.weight if config.tie_word_embeddings else None)
        # float32 regardless of model dtype: the angles of large positions
        # need the mantissa; not a parameter, never saved or loaded.
        cache = cos_sin_cache_for(config)
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)
        # A CPU decode step's layers in one native call each (engine/decode_layers.py),
        # bound at the first forward (weights packed by then); False: not this model.
        self._decode_layers: DecodeLayers | bool | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """Final hidden states [N, hidden] (after the last norm) for the N
        tokens of the batch, flattened across sequences; `positions[i]` is
        token i's position in its own sequence. Call `compute_logits` on the
        rows that need sampling."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be 1-D of equal length, got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        hidden = embed_tokens(input_ids, self.model.embed_tokens.weight, self.shard, self.tp)
        if self._decode_layers is None:  # once: whether the native layer call fits
            self._decode_layers = DecodeLayers.for_model(
                self, (LlamaDecoderLayer, LlamaAttention, LlamaMLP)) or False
        layers_out = self._decode_layers and self._decode_layers.run(hidden, positions, ctx)
        if layers_out:
            hidden, residual = layers_out
        else:
            residual: torch.Tensor | None = None
            for layer in self.model.layers:
                hidden, residual = layer(positions, hidden, residual, self.cos_sin_cache, ctx)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [n, vocab] in float32 for hidden states [n, hidden]. The
        matmul runs in the model dtype (a float32 copy of lm_head would double
        its memory); the result is upcast for sampling. Under `tp` every rank
        must call it (each computes its vocabulary shard); rank 0 gets the
        gathered logits, the others None."""
        logits = self.lm_head(hidden).float()
        return model_logits(logits, self.tp, self.config.vocab_size)

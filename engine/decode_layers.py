"""`DecodeLayers`: a CPU pure-decode step's decoder layers, one native call
each (kernels/native/decode_layer.c).

The call runs the eight kernels the Llama layer calls one at a time
(`engine.model`: the norms, the four projections, the fused decode
attention, SiLU-and-multiply) in the same order on the same rows, so the
result is the same bits; what goes is the Python between them: a module
call, a wrapper, a ctypes call and an output tensor per kernel, ~8 per
layer (docs/engine.md, "Decode layers").

Taken only where every part is the native one the layer would call
anyway: a CPU model of the plain Llama layer (not a subclass: Qwen3's q/k
norms, Gemma's norms, Mixtral's experts keep the layer's own forward), no
tensor parallelism, every projection packed for the native GEMM (float32
or bfloat16), the `auto` kernel backend, and a step that is pure decode
with no layer-KV hook spans or layer gate. The torch profiler also turns
it off, so `bench engine --breakdown` still sees the kernels one by one.
Anything else returns None and the model runs its layers as before.
"""

from __future__ import annotations

import torch

from engine.layer_attention import LayerAttention
from engine.layers.linear import Linear
from engine.paged_attention_context import PagedAttentionContext
from kernels import checks, native
from kernels.dispatch import Backend
from kernels.native.calls import DTYPE_CODES, check

# The fields of decode_layer.c's two arrays, in its L_* and S_* enums' order.
_LAYER_FIELDS = ("in_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "down",
                 "cache", "window")
_STEP_FIELDS = ("batch", "dtype", "hidden_size", "q_heads", "kv_heads", "head_dim", "inter",
                "hidden", "residual", "qkv_buf", "attn_buf", "gate_up_buf", "act_buf",
                "positions", "cos_sin", "max_positions", "slots", "tables", "lens", "num_blocks",
                "block_size", "table_width", "table_stride", "threads", "first")


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class DecodeLayers:
    """Bound once per model (`for_model`); `run` per step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._weights: list[dict[str, int]] | None = None  # per layer: its weight pointers
        self._arrays: list[tuple[torch.Tensor, float, LayerAttention]] = []
        self._arrays_key: tuple | None = None

    @staticmethod
    def for_model(model: torch.nn.Module, layer_types: tuple[type, type, type]
                  ) -> DecodeLayers | None:
        """None when the model's layers are not all exactly `layer_types`
        (the plain Llama layer, its attention and MLP: engine.model passes
        them) with native parts."""
        layer_cls, attention_cls, mlp_cls = layer_types
        if (native.library() is None or model.tp is not None or model.device.type != "cpu"
                or model.dtype not in (torch.float32, torch.bfloat16)
                or Backend.parse(model.kernel_backend) is not Backend.AUTO):
            return None
        for layer in model.model.layers:
            if (type(layer) is not layer_cls or type(layer.self_attn) is not attention_cls
                    or type(layer.mlp) is not mlp_cls):
                return None
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj)
            if not all(type(x) is Linear and x.native for x in linears):
                return None
            if layer.mlp.gate_up_proj.bias is not None or layer.mlp.down_proj.bias is not None:
                return None
            if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
                return None
        return DecodeLayers(model)

    def _bind_weights(self) -> list[dict[str, int]]:
        rows = []
        for layer in self._model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(n.dtype != self._model.dtype or not n.is_contiguous() for n in norms):
                raise ValueError("decode layers: norm weights must be contiguous, model dtype")
            pointers = dict(in_norm=norms[0], post_norm=norms[1], qkv=attn.qkv_proj.weight,
                            qkv_bias=attn.qkv_proj.bias, o=attn.o_proj.weight,
                            o_bias=attn.o_proj.bias, gate_up=mlp.gate_up_proj.weight,
                            down=mlp.down_proj.weight)
            rows.append({name: _ptr(t) for name, t in pointers.items()})
        return rows

    def run(self, hidden: torch.Tensor, positions: torch.Tensor,
            ctx: PagedAttentionContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer of a pure-decode step: (hidden, residual) after the
        last layer, `hidden` (the embeddings, [B, H] contiguous) updated in
        place; None when this step is not one the call takes."""
        model = self._model
        if (not isinstance(ctx, PagedAttentionContext) or ctx.prefill_chunks
                or not ctx.num_decode or ctx.gate is not None or (ctx.hook and ctx.spans)
                or Backend.parse(ctx.kernel_backend) is not Backend.AUTO
                or hidden.dim() != 2 or not hidden.is_contiguous()
                or hidden.shape[0] != ctx.num_decode or torch.autograd._profiler_enabled()):
            return None
        attn = model.model.layers[0].self_attn
        batch, hidden_size = hidden.shape
        dtype, caches = hidden.dtype, ctx.kv_caches
        mlp = model.model.layers[0].mlp
        inter = mlp.down_proj.in_features
        qkv = torch.empty((batch, attn.q_size + 2 * attn.kv_size), dtype=dtype)
        if not native.supports_qkv(qkv, caches[0]):
            return None
        cos_sin = model.cos_sin_cache
        specs = {ctx.layer_spec(i) for i in range(len(model.model.layers))}
        for spec in specs:  # the fused attention's own checks, once per step
            checks.check_decode_qkv_attention(
                qkv, positions, cos_sin, caches[0], ctx.slot_mapping, ctx.decode_block_tables,
                ctx.decode_context_lens, spec.scale, spec.sliding_window, spec.softcap)
        if self._weights is None:
            self._weights = self._bind_weights()
        positions, slots = positions.contiguous(), ctx.slot_mapping.contiguous()
        tables, lens = ctx.decode_block_tables, ctx.decode_context_lens.contiguous()
        residual = torch.empty_like(hidden)
        attn_out = torch.empty((batch, attn.q_size), dtype=dtype)
        gate_up, act = (torch.empty((batch, n), dtype=dtype) for n in (2 * inter, inter))
        _, num_blocks, block_size, num_kv_heads, head_dim = caches[0].shape
        step = dict(
            batch=batch, dtype=DTYPE_CODES[dtype], hidden_size=hidden_size,
            q_heads=attn.num_heads, kv_heads=num_kv_heads, head_dim=head_dim, inter=inter,
            hidden=hidden.data_ptr(), residual=residual.data_ptr(), qkv_buf=qkv.data_ptr(),
            attn_buf=attn_out.data_ptr(), gate_up_buf=gate_up.data_ptr(),
            act_buf=act.data_ptr(), positions=positions.data_ptr(),
            cos_sin=cos_sin.data_ptr(), max_positions=cos_sin.shape[0],
            slots=slots.data_ptr(), tables=tables.data_ptr(), lens=lens.data_ptr(),
            num_blocks=num_blocks, block_size=block_size, table_width=tables.shape[1],
            table_stride=tables.stride(0), threads=torch.get_num_threads())
        # The first layer's array says so (no residual yet); the others' not.
        first, rest = (torch.tensor([{**step, "first": flag}[f] for f in _STEP_FIELDS],
                                    dtype=torch.int64) for flag in (1, 0))
        call = native.library().pdserve_decode_layer
        for i, (layer_array, eps, spec) in enumerate(self._layer_arrays(ctx)):
            check(call(layer_array.data_ptr(), (rest if i else first).data_ptr(), eps,
                       spec.scale, spec.softcap or 0.0), "decode layer")
        return hidden, residual

    def _layer_arrays(self, ctx: PagedAttentionContext
                      ) -> list[tuple[torch.Tensor, float, LayerAttention]]:
        """Each layer's array (weights, its KV cache, its window), its norm
        eps and attention spec; rebuilt only when the caches or specs change."""
        key = (tuple(c.data_ptr() for c in ctx.kv_caches), ctx.layers, ctx.scale,
               ctx.sliding_window)
        if self._arrays_key != key:
            arrays = []
            for i, layer in enumerate(self._model.model.layers):
                spec = ctx.layer_spec(i)
                row = {**self._weights[i], "cache": ctx.kv_caches[i].data_ptr(),
                       "window": spec.sliding_window or 0}
                arrays.append((torch.tensor([row[f] for f in _LAYER_FIELDS], dtype=torch.int64),
                               layer.input_layernorm.eps, spec))
            self._arrays, self._arrays_key = arrays, key
        return self._arrays

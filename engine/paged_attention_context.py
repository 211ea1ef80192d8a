"""`PagedAttentionContext`: attention over the paged KV cache for one step.

Built by `ModelRunner` for each forward pass (engine loop thread only) and
passed to the model as an explicit argument; the model calls
`attend(layer_idx, q, k, v)` once per layer, in layer order.

The batch is flattened with **decode rows first**: sequences computing one
token (decoding, or the last token of a prompt) occupy rows `[0, B)`, then
each prefill chunk occupies a contiguous run of rows. Per layer:

1. the new K/V of all N rows go into the cache in one
   `kernels.inject_kv(cache, [k, v], slot_mapping)`;
2. decode rows attend with `kernels.paged_decode_attention` over their
   block tables (their own K/V are in the cache already);
3. prefill chunks run causal attention with the query offset
   `context_len - num_new`: a chunk that is a whole prompt uses this step's
   K/V rows directly; the others gather their whole context (cached prefix
   + this chunk) with one `kernels.extract_kv` for the step over
   `prefill_context_slots` (None when no chunk needs it). On CPU under
   backend ``auto`` the native kernel (`kernels.native.prefill_attention`,
   q read in place, written into the step's output) when it takes the
   shapes; else, and for soft-capped layers, torch's SDPA;
4. the `LayerKVHook`, if any, receives the layer with this step's spans.

A pure-decode step (no prefill chunk) does 1 and 2 from the qkv
projection's output in one call, RoPE included (`attend_qkv`,
`kernels.decode_qkv_attention`), then 4.

Sliding window W: a query at position p sees keys j with p - W < j <= p
(the convention of `engine.reference` and the kernels). `layers`, when
given, sets each layer's scale, window and soft-cap (`LayerAttention`,
Gemma); without it every layer uses `scale` and `sliding_window`. The
cache keeps every block of a sequence either way: a sliding layer only
reads fewer of them (no eviction of blocks that left the window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from engine.kv_hook import LayerKVHook, LayerKVSpan
from engine.layer_attention import LayerAttention
from engine.layer_gate import HeadLost, LayerGate
from kernels import native
from kernels.dispatch import Backend
from kernels.reference import soft_cap


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Rows `[row_start, row_start + num_new)` of the batch are the last
    `num_new` of the sequence's `context_len` tokens. A chunk with earlier
    context (`needs_context`) finds its context K/V at rows
    `[context_start, context_start + context_len)` of the step's gathered
    context; a whole prompt attends over its own rows (context_start -1)."""

    row_start: int
    num_new: int
    context_start: int
    context_len: int

    @property
    def needs_context(self) -> bool:
        return self.context_len > self.num_new


class PagedAttentionContext:
    """Per-step attention state; see the module docstring for the batch layout."""

    def __init__(self, *, kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                 num_decode: int, decode_block_tables: torch.Tensor,
                 decode_context_lens: torch.Tensor, prefill_chunks: tuple[PrefillChunk, ...],
                 prefill_context_slots: torch.Tensor | None, scale: float,
                 sliding_window: int | None, hook: LayerKVHook | None = None,
                 spans: tuple[LayerKVSpan, ...] = (),
                 gate: LayerGate | None = None,
                 kernel_backend: Backend = Backend.AUTO,
                 layers: tuple[LayerAttention, ...] = ()) -> None:
        self.kv_caches = kv_caches
        self.slot_mapping = slot_mapping
        self.num_decode = num_decode
        self.decode_block_tables = decode_block_tables
        self.decode_context_lens = decode_context_lens
        self.prefill_chunks = prefill_chunks
        self.prefill_context_slots = prefill_context_slots
        self.scale = scale
        self.sliding_window = sliding_window
        self.hook = hook
        self.spans = spans
        # A split prefill's tail (its own forward, engine.tail_worker) reads
        # its head from the cache: each layer waits until the head's KV of
        # that layer has landed (engine.layer_gate), and stops at a failed gate.
        self.gate = gate
        self.kernel_backend = kernel_backend
        # The native prefill kernel is the CPU choice of `auto`, as for the
        # decode kernels (`kernels.dispatch`); `torch` / `triton` keep SDPA.
        self._native_prefill = Backend.parse(kernel_backend) is Backend.AUTO
        self.layers = layers
        self._uniform = LayerAttention(scale, sliding_window)
        # One bound fused op per distinct LayerAttention of the step (one for
        # Llama-family models, two for Gemma 2's sliding and global layers).
        self._fused: dict[LayerAttention, kernels.DecodeQKVAttention] = {}

    def layer_spec(self, layer_idx: int) -> LayerAttention:
        """Layer `layer_idx`'s scale, window and soft-cap."""
        return self.layers[layer_idx] if self.layers else self._uniform

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Called by the model's layer `layer_idx`; see module docstring."""
        if self.gate is not None and not self.gate.wait(layer_idx):
            raise HeadLost(f"the split prefill's head failed before layer {layer_idx}")
        cache = self.kv_caches[layer_idx]
        spec = self.layer_spec(layer_idx)
        kernels.inject_kv(cache, torch.stack((k, v)).to(cache.dtype), self.slot_mapping,
                          backend=self.kernel_backend)
        if self.hook is not None and self.spans:
            self.hook.on_layer_kv(layer_idx, cache, self.spans)
        nd = self.num_decode
        decode_out = None
        if nd:
            decode_out = kernels.paged_decode_attention(
                q[:nd], cache, self.decode_block_tables, self.decode_context_lens,
                scale=spec.scale, sliding_window=spec.sliding_window, softcap=spec.softcap,
                backend=self.kernel_backend,
            )
            if not self.prefill_chunks:
                return decode_out
        out = torch.empty_like(q)
        if decode_out is not None:
            out[:nd] = decode_out
        # Only chunks with a cached prefix (or an earlier chunk) need their
        # context gathered from the cache; a whole prompt's K/V are this
        # step's own rows, bit for bit what the cache now holds.
        context = None
        if self.prefill_context_slots is not None:
            context = kernels.extract_kv(cache, self.prefill_context_slots,
                                         backend=self.kernel_backend)
        for c in self.prefill_chunks:
            rows = slice(c.row_start, c.row_start + c.num_new)
            if not c.needs_context:
                keys, values = k[rows].to(cache.dtype), v[rows].to(cache.dtype)
            else:
                ctx = slice(c.context_start, c.context_start + c.context_len)
                keys, values = context[0, ctx], context[1, ctx]
            self._chunk_attention(q[rows], keys, values, spec, out[rows])
        return out

    def attend_qkv(self, layer_idx: int, qkv: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor) -> torch.Tensor | None:
        """A pure-decode step's layer in one fused call; None (the model's split
        path, then `attend`) when the step has prefill chunks. The step's
        arguments are bound (and checked) at the first layer."""
        if self.prefill_chunks or not self.num_decode:
            return None
        spec = self.layer_spec(layer_idx)
        fused = self._fused.get(spec)
        if fused is None or fused.positions is not positions or (
                fused.cos_sin_cache is not cos_sin_cache):
            fused = self._fused[spec] = kernels.DecodeQKVAttention(
                positions, cos_sin_cache, self.slot_mapping, self.decode_block_tables,
                self.decode_context_lens, scale=spec.scale, sliding_window=spec.sliding_window,
                softcap=spec.softcap, backend=self.kernel_backend)
        cache = self.kv_caches[layer_idx]
        out = fused(qkv, cache)
        if self.hook is not None and self.spans:
            self.hook.on_layer_kv(layer_idx, cache, self.spans)
        return out

    def _chunk_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         spec: LayerAttention, out: torch.Tensor) -> None:
        """Causal attention of the last `len(q)` positions over `len(k)` keys,
        written into `out` (a contiguous [len(q), Hq, D] view of the step's output).

        On CPU under `auto`, the native kernel reads q, k and v where they
        are (q and v are views of the qkv projection's rows), 1.4-2.3x
        SDPA's speed (docs/kernels.md, "Prefill attention"); it cannot
        soft-cap, and takes head dims that are multiples of 16 up to 256 on
        an AVX2 CPU. Otherwise the inputs go to SDPA as contiguous 4-D
        tensors with GQA left to SDPA: that is what selects torch's fused
        (flash) CPU kernel; 3-D or strided inputs fall back to the math
        path, which materialises the scores and was 3.5x slower on a
        1,024-token prompt (benchmarks/results/history/engine.md, "Engine
        step: prepacked linears, CPU attention paths"). A soft-capped layer
        takes `_capped_attention`.
        """
        if (self._native_prefill and spec.softcap is None
                and native.supports_prefill_attention(q, k, v)):
            native.prefill_attention(q, k, v, scale=spec.scale,
                                     sliding_window=spec.sliding_window, out=out)
            return
        out.copy_(self._torch_chunk_attention(q, k, v, spec))

    @staticmethod
    def _torch_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               spec: LayerAttention) -> torch.Tensor:
        num_new = q.shape[0]
        context_len = k.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0).contiguous()                # [1, Hq, n, D]
        kh = k.to(q.dtype).transpose(0, 1).unsqueeze(0).contiguous()    # [1, Hkv, L, D]
        vh = v.to(q.dtype).transpose(0, 1).unsqueeze(0).contiguous()
        if num_new == context_len and spec.sliding_window is None and spec.softcap is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=spec.scale,
                                                 enable_gqa=True)
            return out[0].transpose(0, 1)
        query_pos = torch.arange(context_len - num_new, context_len, device=q.device)[:, None]
        key_pos = torch.arange(context_len, device=q.device)[None, :]
        visible = key_pos <= query_pos
        if spec.sliding_window is not None:
            visible &= key_pos > query_pos - spec.sliding_window
        if spec.softcap is not None:
            return _capped_attention(qh[0], kh[0], vh[0], visible, spec)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible[None, None],
                                             scale=spec.scale, enable_gqa=True)
        return out[0].transpose(0, 1)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      visible: torch.Tensor, spec: LayerAttention) -> torch.Tensor:
    """q [Hq, n, D], k and v [Hkv, L, D], visible [n, L] -> [n, Hq, D] in q's
    dtype: scores, soft-cap, mask and softmax in float32 (one chunk's scores
    are materialised; Gemma 2 prompts only)."""
    group = q.shape[0] // k.shape[0]
    keys = k.float().repeat_interleave(group, dim=0)
    values = v.float().repeat_interleave(group, dim=0)
    scores = soft_cap(torch.matmul(q.float(), keys.transpose(1, 2)) * spec.scale, spec.softcap)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs, values).transpose(0, 1).to(q.dtype)

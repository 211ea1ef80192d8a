"""Fused ops of a decoder layer: what lies between two linears, in one call.

A CPU decode step at small batch streams each linear's weights (10-20 MB)
from memory, which evicts what the small ops between two linears touch:
their Python, torch's dispatch, their tensors. Each small op then costs
several times what it costs in a loop of its own (an RMSNorm call: 14 us
alone, 45-60 us right after a linear), so the step pays per op, not per
byte. These ops each replace a run of them:

- `silu_and_mul`: SwiGLU's `F.silu(gate) * up` on the merged gate/up
  projection's output (split, silu, multiply: three ops and two temporaries);
- `decode_qkv_attention`: the attention block of a pure-decode step from the
  merged qkv projection's output: split, RoPE of q and k, the K/V write into
  the paged cache, decode attention (some ten ops, among them the stack of
  k and v and the inject's checks);
- `ResidualRMSNorm`: the residual stream's RMSNorm in place, bound to its
  weight, with its checks done once per layout instead of per call.

Same backend choice as `kernels.dispatch`: under ``auto`` on CPU the native C
kernels (`kernels.native`) when they built; ``torch`` (and CPU without the
library) the composition of the references; ``triton`` (and ``auto`` on
CUDA) the Triton kernels of the same steps, with torch's silu and multiply.
Arguments are checked the same way for every backend (`kernels.checks`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import checks, dispatch, native
from kernels.dispatch import Backend


def _native(device: torch.device, backend: Backend | str) -> bool:
    return (device.type == "cpu" and Backend.parse(backend) is Backend.AUTO
            and native.library() is not None)


def silu_and_mul(x: torch.Tensor, *, backend: Backend | str = Backend.AUTO) -> torch.Tensor:
    """x [N, 2I] = [gate | up] -> silu(gate) * up [N, I], a new tensor in x.dtype.

    silu is computed in float32 and rounded to x.dtype before the product,
    as `F.silu(gate) * up` rounds; the native kernel's exp is a polynomial
    within a few float32 ulp of torch's.
    """
    checks.check_silu_and_mul(x)
    if _native(x.device, backend):
        return native.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def decode_qkv_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    backend: Backend | str = Backend.AUTO,
) -> torch.Tensor:
    """Attention of B decode rows from their qkv projection; returns [B, Hq, D].

    qkv [B, (Hq + 2 Hkv) * D] holds each row's q, k and v heads in that order
    (rows may be strided, each row contiguous); Hkv and D are the cache's.
    In order: neox RoPE of q and k at `positions` [B] int64 (`cos_sin_cache`
    as for `rotary_embedding`); k and v into the cache at `slot_mapping` [B]
    int64 (negative: padding, nothing written, as for `inject_kv`); decode
    attention of the rotated q over `block_tables` / `context_lens` (each row's
    own new token included, `sliding_window` and `softcap` too), as
    `paged_decode_attention`. qkv is scratch: its
    contents afterwards are unspecified (the native kernel rotates q in place).
    Same contracts on values as those three ops (not checked on the host).
    For every layer of one step, `DecodeQKVAttention` checks the step's
    arguments once.
    """
    return DecodeQKVAttention(positions, cos_sin_cache, slot_mapping, block_tables, context_lens,
                              scale=scale, sliding_window=sliding_window, softcap=softcap,
                              backend=backend)(qkv, kv_cache)


class DecodeQKVAttention:
    """`decode_qkv_attention` with one step's arguments bound, called once per
    layer with that layer's qkv and cache.

    The first call checks everything; later calls check only that qkv and the
    cache have the shape, strides, dtype and device of the last checked ones
    (a tuple comparison; a model's layers never differ) and check fully again
    if not. The step's tensors must not be resized while bound.
    """

    def __init__(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, *, scale: float, sliding_window: int | None = None,
                 softcap: float | None = None, backend: Backend | str = Backend.AUTO) -> None:
        self.positions = positions
        self.cos_sin_cache = cos_sin_cache
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.context_lens = context_lens
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.backend = Backend.parse(backend)
        self._checked: tuple | None = None
        self._num_q_heads = 0
        self._native: native.DecodeQKVCall | None = None

    def __call__(self, qkv: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        layout = (qkv.shape, qkv.stride(), qkv.dtype, qkv.device,
                  kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device)
        if layout != self._checked:
            self._check(qkv, kv_cache)
            self._checked = layout
        if self._native is not None:
            return self._native(qkv, kv_cache)
        return self._composed(qkv, kv_cache)

    def _check(self, qkv: torch.Tensor, kv_cache: torch.Tensor) -> None:
        self._num_q_heads = checks.check_decode_qkv_attention(
            qkv, self.positions, self.cos_sin_cache, kv_cache, self.slot_mapping,
            self.block_tables, self.context_lens, self.scale, self.sliding_window, self.softcap)
        self._native = None
        if _native(qkv.device, self.backend) and native.supports_qkv(qkv, kv_cache):
            self._native = native.DecodeQKVCall(
                self.positions, self.cos_sin_cache, self.slot_mapping, self.block_tables,
                self.context_lens, num_q_heads=self._num_q_heads,
                kv_cache_shape=tuple(kv_cache.shape), dtype=qkv.dtype, scale=self.scale,
                sliding_window=self.sliding_window, softcap=self.softcap)

    def _composed(self, qkv: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """The same steps through `kernels.dispatch` (Triton, or the torch paths)."""
        batch, (num_kv_heads, head_dim) = qkv.shape[0], kv_cache.shape[3:]
        q, k, v = qkv.split([self._num_q_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim], dim=-1)
        q, k = dispatch.rotary_embedding(
            self.positions, q.reshape(batch, self._num_q_heads, head_dim),
            k.reshape(batch, num_kv_heads, head_dim), self.cos_sin_cache, backend=self.backend)
        dispatch.inject_kv(kv_cache, torch.stack((k, v.reshape(batch, num_kv_heads, head_dim))),
                           self.slot_mapping, backend=self.backend)
        return dispatch.paged_decode_attention(
            q, kv_cache, self.block_tables, self.context_lens, scale=self.scale,
            sliding_window=self.sliding_window, softcap=self.softcap, backend=self.backend)


class ResidualRMSNorm:
    """`rms_norm(x, weight, eps, residual, out=x, residual_out=residual)` for
    one weight: the residual stream's norm, in place (x <- norm(x + residual)
    * weight, residual <- x + residual, both returned).

    The first call checks everything; later calls check only that x and
    residual have the shape, strides, dtype and device of the last checked
    ones (one tuple comparison) and check fully again if not, then go
    straight to the kernel: a decode step calls this twice per layer, right
    after a linear, where every line of Python runs with cold caches.
    """

    def __init__(self, weight: torch.Tensor, eps: float, *,
                 backend: Backend | str = Backend.AUTO) -> None:
        self.weight = weight
        self.eps = eps
        self.backend = Backend.parse(backend)
        self._checked: tuple | None = None
        self._native = False

    def __call__(self, x: torch.Tensor,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layout = (x.shape, x.stride(), x.dtype, x.device,
                  residual.shape, residual.stride(), residual.dtype, residual.device)
        if layout != self._checked:
            checks.check_rms_norm(x, self.weight, self.eps, residual, x, residual)
            self._native = (_native(x.device, self.backend)
                            and native.supports_rms_norm(x, self.weight, residual))
            self._checked = layout
        if self._native:
            return native.rms_norm(x, self.weight, self.eps, residual, out=x,
                                   residual_out=residual)
        return dispatch.rms_norm(x, self.weight, self.eps, residual, out=x,
                                 residual_out=residual, backend=self.backend)


__all__ = ["DecodeQKVAttention", "ResidualRMSNorm", "decode_qkv_attention", "silu_and_mul"]

"""Neox-style rotary position embedding (rotate halves) in Triton.

For a head vector x = [x1, x2] (halves of D) at position p, with c, s the
cos/sin row p of the cache: out = [x1*c - x2*s, x2*c + x1*s], in fp32,
stored in x.dtype. Scalings such as llama3's are baked into the cache by the
model, so the kernel only applies it. A half is a tile of HALF_PAD = HALF
rounded up to a power of two (head dim 96: 48 in 64), every load and store
masked to the HALF real lanes. One program rotates HEADS_TILE heads
of one token; q and k are two launches of the same kernel. Outputs are new
tensors (inputs untouched), matching the torch reference.

Called by `kernels.dispatch.rotary_embedding` (engine loop thread, every
layer) after `kernels.checks.check_rotary`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import HEAD_DIMS
from kernels.paged_attention import head_dim_mask

HEADS_TILE = 4
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True, slots=True)
class RotaryConfig:
    """Compile-time choices of the RoPE kernel."""

    dtype: str
    head_dim: int

    def __post_init__(self) -> None:
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim} not one of {HEAD_DIMS}")

    @property
    def half_pad(self) -> int:
        """Lanes of a half's tile (constexpr HALF_PAD): head_dim / 2 rounded up to a power
        of two."""
        return 1 << (self.head_dim // 2 - 1).bit_length()


def rotary_config(dtype: torch.dtype, head_dim: int) -> RotaryConfig:
    """The one place a RoPE variant is chosen (launcher and AOT test share it)."""
    return RotaryConfig(_DTYPE_NAMES[dtype], head_dim)


def all_rotary_configs() -> list[RotaryConfig]:
    return [rotary_config(dtype, head_dim) for dtype in _DTYPE_NAMES for head_dim in HEAD_DIMS]


@triton.jit
def _rotary_kernel(
    positions_ptr, x_ptr, out_ptr, cos_sin_ptr, num_heads,
    stride_xt, stride_xh, stride_ot, stride_oh,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_TILE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_TILE + tl.arange(0, HEADS_TILE)
    dims = tl.arange(0, HALF_PAD)
    dim_ok = head_dim_mask(dims, HALF, HALF_PAD)  # lanes past HALF: never loaded or stored
    mask = (heads < num_heads)[:, None] & dim_ok[None, :]
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + position * (2 * HALF) + dims, mask=dim_ok, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + position * (2 * HALF) + HALF + dims, mask=dim_ok,
                  other=0.0)[None, :]
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    kind = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(kind), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(kind), mask=mask)


def _rotate(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
    out: torch.Tensor | None, config: RotaryConfig,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match {tuple(x.shape)} "
                         f"{x.dtype} with a contiguous last dimension")
    if num_tokens == 0 or num_heads == 0:
        return out
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, HEADS_TILE))](
        positions, x, out, cos_sin_cache, num_heads,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        HALF=head_dim // 2, HALF_PAD=config.half_pad, HEADS_TILE=HEADS_TILE, num_warps=4,
    )
    return out


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher; inputs validated by `kernels.checks.check_rotary`.

    Returns new (q, k), or writes the preallocated q_out / k_out. Positions
    must be < cos_sin_cache.shape[0] (not checked: that needs a device sync).
    """
    config = rotary_config(q.dtype, q.shape[2])  # refuses shapes no compiled variant covers
    return (_rotate(positions, q, cos_sin_cache, q_out, config),
            _rotate(positions, k, cos_sin_cache, k_out, config))

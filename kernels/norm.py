"""RMSNorm with an optional fused residual add, in Triton.

(Named `norm`, not `rms_norm`, so the submodule never shadows the
`kernels.rms_norm` function on the package.)

One program normalises one row of x [N, H]: it loads the whole row (padded
to a power-of-two tile), adds the residual if given, rounds that sum to
x.dtype and stores it (the next layer's residual), then computes the mean
square in fp32 and writes `r * rsqrt(mean(r^2) + eps) * weight` in x.dtype.
Fusing the add saves one read and one write of the hidden state per layer.

Called by `kernels.dispatch.rms_norm` (the engine loop thread, every
layer, twice) after `kernels.checks.check_rms_norm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import MAX_HIDDEN

MIN_BLOCK_H = 256
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True, slots=True)
class RmsNormConfig:
    """Compile-time choices of the RMSNorm kernel."""

    dtype: str  # x (and residual, outputs) dtype
    weight_dtype: str
    block_h: int  # row tile: a power of two >= hidden
    has_residual: bool
    num_warps: int

    def __post_init__(self) -> None:
        if self.block_h & (self.block_h - 1) or not MIN_BLOCK_H <= self.block_h <= MAX_HIDDEN:
            raise ValueError(f"block_h {self.block_h} must be a power of two in "
                             f"{MIN_BLOCK_H}..{MAX_HIDDEN}")


def rms_norm_config(
    dtype: torch.dtype, weight_dtype: torch.dtype, hidden: int, has_residual: bool
) -> RmsNormConfig:
    """The one place an RMSNorm variant is chosen (launcher and AOT test share it)."""
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} outside 1..{MAX_HIDDEN}")
    block_h = max(MIN_BLOCK_H, 1 << (hidden - 1).bit_length())
    # About 16 fp32 values of the row per thread (32 at the 16384 maximum):
    # at 32 per thread the 8192 half-precision rows spill on sm_90.
    num_warps = min(16, max(4, block_h // (32 * 16)))
    return RmsNormConfig(
        _DTYPE_NAMES[dtype], _DTYPE_NAMES[weight_dtype], block_h, has_residual, num_warps
    )


def all_rms_norm_configs() -> list[RmsNormConfig]:
    hiddens = []
    block_h = MIN_BLOCK_H
    while block_h <= MAX_HIDDEN:
        hiddens.append(block_h)
        block_h *= 2
    return [
        rms_norm_config(dtype, weight_dtype, hidden, has_residual)
        for dtype in _DTYPE_NAMES
        for weight_dtype in _DTYPE_NAMES
        for hidden in hiddens
        for has_residual in (False, True)
    ]


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, y_ptr, r_out_ptr, hidden, eps,
    stride_x, stride_residual, stride_y, stride_r_out,
    BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    in_row = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=0.0)
    if HAS_RESIDUAL:
        summed = x.to(tl.float32) + tl.load(
            residual_ptr + row * stride_residual + cols, mask=in_row, other=0.0
        ).to(tl.float32)
        # Round before normalising: the stored sum is what the next layer adds.
        x = summed.to(x_ptr.dtype.element_ty)
        tl.store(r_out_ptr + row * stride_r_out + cols, x, mask=in_row)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (xf * inv_rms * weight).to(y_ptr.dtype.element_ty),
             mask=in_row)


def _output(given: torch.Tensor | None, x: torch.Tensor, name: str) -> torch.Tensor:
    if given is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if given.shape != x.shape or given.dtype != x.dtype or given.stride(-1) != 1:
        raise ValueError(f"{name} {tuple(given.shape)} {given.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype} with a contiguous last dimension")
    return given


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launcher; inputs validated by `kernels.checks.check_rms_norm`.

    Returns new tensors, or writes the preallocated `out` (and, with a
    residual, `residual_out`), each [N, H] in x.dtype with a contiguous last dim.
    """
    num_tokens, hidden = x.shape
    config = rms_norm_config(x.dtype, weight.dtype, hidden, residual is not None)
    y = _output(out, x, "out")
    r_out = _output(residual_out, x, "residual_out") if residual is not None else y
    # Without a residual the residual pointers are never dereferenced
    # (HAS_RESIDUAL is a constexpr), so x stands in for them.
    res = residual if residual is not None else x
    if num_tokens > 0:
        _rms_norm_kernel[(num_tokens,)](
            x, res, weight, y, r_out, hidden, eps,
            x.stride(0), res.stride(0), y.stride(0), r_out.stride(0),
            BLOCK_H=config.block_h, HAS_RESIDUAL=residual is not None,
            num_warps=config.num_warps,
        )
    return (y, r_out) if residual is not None else y

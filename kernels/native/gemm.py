"""The native GEMM's wrappers (kernels/native/gemm.c, gemm_bf16.c): weights
packed in 16-column panels (`pack_panels`, `pack_panels_bf16`) and every
row of a projection multiplied against them (`gemm_panels`,
`gemm_panels_bf16`). Re-exported by `kernels.native`, whose names callers use.
"""

from __future__ import annotations

import functools

import torch

from kernels import huge_pages
from kernels.native.calls import check, profiled
from kernels.native.loader import library

GEMM_PROFILER_NAME = "pdserve_native::gemm_panels"

PANEL = 16  # output columns per panel of a packed weight (gemm.c)


def gemm_available() -> bool:
    """Whether `gemm_panels` runs here: the library built, for a CPU with AVX2 and FMA."""
    lib = library()
    return lib is not None and bool(lib.pdserve_gemm_available())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] (F.linear's layout) as gemm.c's panels
    [ceil(N / 16), K, 16]: panel j holds output columns 16 j .. 16 j + 15,
    K-major, zero past N."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels takes a float32 CPU weight [N, K], got "
                         f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
    return _panels(weight)


def _by_panel(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as [ceil(N / 16), 16, K], zero past N."""
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, k)
    padded[:n] = weight
    return padded.view(num_panels, PANEL, k)


def _panels(weight: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """weight [N, K] as [ceil(N / 16), K, 16], zero past N; `order`: the
    column each position of a panel row holds (natural order if None)."""
    panels = _by_panel(weight)
    if order is not None:
        panels = panels[:, torch.tensor(order)]
    # Streamed whole by every decode step: on huge pages (kernels/huge_pages.py).
    return huge_pages.copy_of(panels.transpose(1, 2))


def gemm_panels(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                num_threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 (rows may be strided) @ the packed weight's
    transpose (+ bias): [M, out_features], written to `out` (rows contiguous,
    may be strided apart) when given. Each output element is one
    multiply-add chain over K in order: a row's result does not depend on
    M or on the thread count."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"gemm_panels takes float32 CPU rows [M, K], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, in_features = x.shape
    if panels.shape[1] != in_features or panels.shape[0] * PANEL < out_features:
        raise ValueError(f"x has {in_features} features; panels {tuple(panels.shape)} "
                         f"do not hold a [{out_features}, {in_features}] weight")
    if out is None:
        out = torch.empty((rows, out_features), dtype=torch.float32)
    elif out.shape != (rows, out_features) or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {out_features}] with contiguous rows")
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    with profiled(GEMM_PROFILER_NAME):
        code = library().pdserve_gemm_panels(
            x.data_ptr(), x.stride(0), rows, panels.data_ptr(), in_features, out_features,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            num_threads or torch.get_num_threads())
    check(code, "gemm_panels")
    return out


# Where pack_panels_bf16 puts column c of a panel row: the two unpacks of
# gemm_bf16.c against zero turn positions 0-3, 8-11 into columns 0-7 and
# positions 4-7, 12-15 into columns 8-15 (position p holds column _BF16_ORDER[p]).
_BF16_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


def gemm_bf16_available() -> bool:
    """Whether `gemm_panels_bf16` runs here (the library built, AVX2 and FMA)."""
    lib = library()
    return lib is not None and bool(lib.pdserve_gemm_bf16_available())


@functools.cache
def gemm_bf16_pairs() -> bool:
    """Whether gemm_bf16.c multiplies k in pairs here (AVX512-BF16's
    `vdpbf16ps`), for weights whose K is even: their panels then hold each
    panel row pair's 16 columns interleaved (`pack_panels_bf16`)."""
    lib = library()
    return lib is not None and bool(lib.pdserve_gemm_bf16_pairs())


def pack_panels_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [N, K] as gemm_bf16.c's panels [ceil(N / 16), K, 16]
    (bfloat16). Where `gemm_bf16_pairs()` and K is even, panel j's rows 2q
    and 2q + 1 hold (W[16 j + c][2 q], W[16 j + c][2 q + 1]) for c = 0 .. 15
    in turn; elsewhere each panel row's columns are in the order gemm_bf16.c
    unpacks."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels_bf16 takes a bfloat16 CPU weight [N, K], got "
                         f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
    k = weight.shape[1]
    if not (k % 2 == 0 and gemm_bf16_pairs()):
        return _panels(weight, _BF16_ORDER)
    panels = _by_panel(weight)
    # [P, 16 columns, K / 2 pairs, 2] -> [P, K / 2, 16, 2]: a pair row's columns in turn
    pairs = panels.view(panels.shape[0], PANEL, k // 2, 2).permute(0, 2, 1, 3)
    return huge_pages.copy_of(pairs).view(panels.shape[0], k, PANEL)


def gemm_panels_bf16(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                     bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                     num_threads: int | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 (rows may be strided) @ the packed bfloat16 weight's
    transpose (+ a float32 bias), accumulated in float32 and rounded once to
    bfloat16: [M, out_features] bfloat16, into `out` (contiguous rows) when
    given. A row's result does not depend on M or on the thread count."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"gemm_panels_bf16 takes bfloat16 CPU rows [M, K], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, in_features = x.shape
    if (panels.dtype != torch.bfloat16 or panels.shape[1] != in_features
            or panels.shape[0] * PANEL < out_features):
        raise ValueError(f"x has {in_features} features; panels {panels.dtype} "
                         f"{tuple(panels.shape)} do not hold a [{out_features}, "
                         f"{in_features}] bfloat16 weight")
    if out is None:
        out = torch.empty((rows, out_features), dtype=torch.bfloat16)
    elif out.shape != (rows, out_features) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out must be bfloat16 [{rows}, {out_features}] with contiguous rows")
    if bias is not None:
        bias = bias.float().contiguous()
    with profiled(GEMM_PROFILER_NAME):
        code = library().pdserve_gemm_panels_bf16(
            x.data_ptr(), x.stride(0), rows, panels.data_ptr(), in_features, out_features,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            num_threads or torch.get_num_threads())
    check(code, "gemm_panels_bf16")
    return out

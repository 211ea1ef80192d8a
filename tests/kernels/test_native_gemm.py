"""kernels/native/gemm.c (the float32 GEMM over 16-column panels: groups of
4, 2 and 1 rows below 24 rows, with 8 first where the CPU has AVX-512;
packed 6-row tiles from 24) against a float64 torch reference on fresh
random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels import native

pytestmark = pytest.mark.skipif(not native.gemm_available(),
                                reason="native GEMM unavailable (no compiler, or no AVX2 + FMA)")


def _case(seed: int, rows: int, k: int, n: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, weight, b


def _reference(x, weight, bias):
    out = x.double() @ weight.double().t()
    return (out if bias is None else out + bias.double()).float()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16, 23, 96, 97, 200])
@pytest.mark.parametrize("k,n,bias", [(1, 1, False), (7, 15, True), (256, 16, False),
                                      (257, 17, True), (1000, 100, False), (64, 300, True)])
def test_matches_float64_reference(rows, k, n, bias, threads):
    x, weight, b = _case(rows * 1009 + k * 31 + n, rows, k, n, bias)
    panels = native.pack_panels(weight)
    assert panels.shape == (-(-n // 16), k, 16)
    got = native.gemm_panels(x, panels, n, b, num_threads=threads)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # float32 sums of k products: rounding grows with sqrt(k) * |x| |w|.
    torch.testing.assert_close(got, _reference(x, weight, b), rtol=1e-5,
                               atol=1e-5 * (k ** 0.5) * 4)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [6, 12, 24, 37, 96, 200, 385, 1030])
@pytest.mark.parametrize("k,n,bias", [(7, 15, True), (257, 17, True), (300, 100, False),
                                      (1000, 33, True)])
def test_prefill_rows_match_float64_reference(rows, k, n, bias, threads):
    """From 24 rows the 6-row tiles: packed rows, a remainder under 6 rows,
    blocks of 192 rows, panels shared out (under 192 rows a thread) or rows."""
    x, weight, b = _case(rows * 7919 + k * 13 + n, rows, k, n, bias)
    got = native.gemm_panels(x, native.pack_panels(weight), n, b, num_threads=threads)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, _reference(x, weight, b), rtol=1e-5,
                               atol=1e-5 * (k ** 0.5) * 4)


@pytest.mark.parametrize("rows,threads", [(24, 2), (37, 3), (200, 2), (1030, 2), (1030, 3)])
def test_prefill_rows_equal_the_same_rows_alone(rows, threads):
    """The 6-row path (any block, tile or remainder, any thread split) gives
    each row bit for bit what the decode path gives it alone: one FMA chain
    over k in order per output on both."""
    x, weight, b = _case(rows, rows, 515, 70, True)
    panels = native.pack_panels(weight)
    together = native.gemm_panels(x, panels, 70, b, num_threads=threads)
    picks = sorted({0, 5, 6, 15, rows // 2, rows - 7, rows - 1} & set(range(rows)))
    for i in picks:
        assert torch.equal(native.gemm_panels(x[i : i + 1], panels, 70, b), together[i : i + 1])
    assert torch.equal(native.gemm_panels(x[:8], panels, 70, b), together[:8])  # 4-row groups
    assert torch.equal(native.gemm_panels(x, panels, 70, b, num_threads=1), together)


def test_a_row_does_not_depend_on_the_batch_or_the_threads():
    """One multiply-add chain per output in k order: bit-identical whether a
    row is alone, in a group of 8, 4, 2 or 1, or computed by another thread."""
    # 13 x 700 x 200 multiply-adds: past gemm.c's PARALLEL_MIN, so the batch
    # is split over threads while a lone row (below it) runs on one.
    x, weight, b = _case(3, 13, 700, 200, True)
    panels = native.pack_panels(weight)
    together = native.gemm_panels(x, panels, 200, b, num_threads=2)
    for threads in (1, 3):
        assert torch.equal(native.gemm_panels(x, panels, 200, b, num_threads=threads), together)
    for i in range(13):
        assert torch.equal(native.gemm_panels(x[i : i + 1], panels, 200, b), together[i : i + 1])
    assert torch.equal(native.gemm_panels(x[5:11], panels, 200, b), together[5:11])


def test_strided_rows_in_and_out():
    x, weight, _ = _case(4, 6, 100, 40, False)
    wide = torch.randn(6, 150)
    wide[:, 20:120] = x
    out = torch.full((6, 64), float("nan"))
    panels = native.pack_panels(weight)
    native.gemm_panels(wide[:, 20:120], panels, 40, out=out[:, 10:50])
    torch.testing.assert_close(out[:, 10:50], _reference(x, weight, None), rtol=1e-5, atol=1e-4)
    assert out[:, :10].isnan().all() and out[:, 50:].isnan().all()  # nothing else written


def test_zero_rows_and_refusals():
    _, weight, _ = _case(5, 1, 32, 20, False)
    panels = native.pack_panels(weight)
    assert native.gemm_panels(torch.empty(0, 32), panels, 20).shape == (0, 20)
    with pytest.raises(ValueError, match="float32 CPU rows"):
        native.gemm_panels(torch.randn(2, 32).double(), panels, 20)
    with pytest.raises(ValueError, match="x has 31 features"):
        native.gemm_panels(torch.randn(2, 31), panels, 20)
    with pytest.raises(ValueError, match="do not hold a \\[40, 32\\] weight"):
        native.gemm_panels(torch.randn(2, 32), panels, 40)
    with pytest.raises(ValueError, match="out must be \\[2, 20\\]"):
        native.gemm_panels(torch.randn(2, 32), panels, 20, out=torch.empty(2, 21))
    with pytest.raises(ValueError, match="float32 CPU weight"):
        native.pack_panels(weight.bfloat16())

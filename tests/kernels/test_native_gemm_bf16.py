"""kernels/native/gemm_bf16.c (the bfloat16 GEMM over 16-column bfloat16
panels, float32 accumulation; k in pairs with `vdpbf16ps` where the CPU has
AVX512-BF16 and K is even) against a float64 torch reference on fresh
random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels import native

pytestmark = pytest.mark.skipif(not native.gemm_bf16_available(),
                                reason="native GEMM unavailable (no compiler, or no AVX2 + FMA)")


def _case(seed: int, rows: int, k: int, n: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None  # float32, as a packed layer holds it
    return x, weight, b


def _reference(x, weight, bias):
    out = x.double() @ weight.double().t()
    return out if bias is None else out + bias.double()


def _assert_rounded_reference(got, x, weight, bias):
    """Each output is the float32 sum rounded once to bfloat16: within half a
    bfloat16 ulp (2^-8 relative) of the exact value plus the float32
    summation's error, and equal to the exact value rounded to bfloat16 but
    where that value lies within the summation error of a rounding boundary."""
    exact = _reference(x, weight, bias)
    magnitude = x.double().abs() @ weight.double().abs().t()
    summation = 2.0 ** -23 * x.shape[1] * magnitude
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + summation + 1e-30).all()
    mismatched = (got != exact.to(torch.bfloat16)).double().mean().item()
    assert mismatched <= 0.01


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 29, 97])
@pytest.mark.parametrize("k,n,bias", [(1, 1, False), (7, 15, True), (128, 16, False),
                                      (129, 17, True), (1000, 100, False), (64, 300, True)])
def test_matches_float64_reference(rows, k, n, bias, threads):
    x, weight, b = _case(rows * 1009 + k * 31 + n, rows, k, n, bias)
    panels = native.pack_panels_bf16(weight)
    assert panels.shape == (-(-n // 16), k, 16) and panels.dtype == torch.bfloat16
    got = native.gemm_panels_bf16(x, panels, n, b, num_threads=threads)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    _assert_rounded_reference(got, x, weight, b)


def test_every_column_lands_in_its_place():
    """The panels store each row's 16 columns in the order the kernel's
    unpacks restore: a one-hot weight row per output column must come back
    in that column (a permutation error would move it)."""
    n, k = 37, 16
    weight = torch.zeros(n, k, dtype=torch.bfloat16)
    for col in range(n):
        weight[col, col % k] = col + 1  # integers: exact in bfloat16
    x = torch.eye(k, dtype=torch.bfloat16)
    got = native.gemm_panels_bf16(x, native.pack_panels_bf16(weight), n)
    assert torch.equal(got, (x.float() @ weight.float().t()).bfloat16())


def test_a_row_does_not_depend_on_the_batch_or_the_threads():
    """One multiply-add chain per output in k order, rounded once: bit-identical
    whether a row is alone, in a group of 16, 8, 4, 2 or 1, or on another
    thread."""
    x, weight, b = _case(3, 29, 700, 200, True)
    panels = native.pack_panels_bf16(weight)
    together = native.gemm_panels_bf16(x, panels, 200, b, num_threads=2)
    for threads in (1, 3):
        assert torch.equal(native.gemm_panels_bf16(x, panels, 200, b, num_threads=threads),
                           together)
    assert torch.equal(native.gemm_panels_bf16(x[3:12], panels, 200, b), together[3:12])
    for i in range(29):
        assert torch.equal(native.gemm_panels_bf16(x[i : i + 1], panels, 200, b),
                           together[i : i + 1])


@pytest.mark.parametrize("rows,threads", [(24, 2), (37, 3), (200, 2), (1030, 2), (1030, 3)])
def test_prefill_rows_equal_the_same_rows_alone(rows, threads):
    """Prefill rows (widened panels on gemm.c's tiles) give each row what the
    decode groups give it alone, bit for bit, with a bias and a ragged last
    panel, and match the float64 reference."""
    x, weight, b = _case(5, rows, 300, 1100, True)
    panels = native.pack_panels_bf16(weight)
    together = native.gemm_panels_bf16(x, panels, 1100, b, num_threads=threads)
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(native.gemm_panels_bf16(x[i : i + 1], panels, 1100, b),
                           together[i : i + 1])
    assert torch.equal(native.gemm_panels_bf16(x[:8], panels, 1100, b), together[:8])
    _assert_rounded_reference(together, x, weight, b)


def test_rounding_is_to_nearest_even_and_keeps_nan_and_inf():
    """One k term, weight 1: the output is the bias-free float32 sum x * 1 +
    bias, rounded as torch rounds float32 to bfloat16 (ties to even)."""
    k, n = 1, 16
    weight = torch.ones(n, k, dtype=torch.bfloat16)
    x = torch.ones(1, k, dtype=torch.bfloat16)
    # 1 + bias: ties between bfloat16 neighbours (2^-8 past 1), either side, NaN, inf
    bias = torch.tensor([2.0 ** -8, 3 * 2.0 ** -8, 2.0 ** -8 + 2.0 ** -20, 2.0 ** -9, -2.0 ** -9,
                         float("nan"), float("inf"), -float("inf"), 0.0, 1.0, 2.0 ** -7,
                         -3.0, 1e30, -1e-30, 5 * 2.0 ** -8, 7 * 2.0 ** -8])
    got = native.gemm_panels_bf16(x, native.pack_panels_bf16(weight), n, bias)
    expected = (1.0 + bias).bfloat16()
    got = got[0]
    assert torch.equal(got.isnan(), expected.isnan())
    keep = ~expected.isnan()
    assert torch.equal(got[keep], expected[keep])


def test_strided_rows_in_and_out():
    x, weight, _ = _case(4, 6, 100, 40, False)
    wide = torch.randn(6, 150).bfloat16()
    wide[:, 20:120] = x
    out = torch.full((6, 64), float("nan"), dtype=torch.bfloat16)
    native.gemm_panels_bf16(wide[:, 20:120], native.pack_panels_bf16(weight), 40,
                            out=out[:, 10:50])
    _assert_rounded_reference(out[:, 10:50], x, weight, None)
    assert out[:, :10].isnan().all() and out[:, 50:].isnan().all()  # nothing else written


def test_zero_rows_and_refusals():
    _, weight, _ = _case(5, 1, 32, 20, False)
    panels = native.pack_panels_bf16(weight)
    assert native.gemm_panels_bf16(torch.empty(0, 32, dtype=torch.bfloat16), panels,
                                   20).shape == (0, 20)
    with pytest.raises(ValueError, match="bfloat16 CPU rows"):
        native.gemm_panels_bf16(torch.randn(2, 32), panels, 20)
    with pytest.raises(ValueError, match="x has 31 features"):
        native.gemm_panels_bf16(torch.randn(2, 31).bfloat16(), panels, 20)
    with pytest.raises(ValueError, match="do not hold a \\[40, 32\\] bfloat16 weight"):
        native.gemm_panels_bf16(torch.randn(2, 32).bfloat16(), panels, 40)
    with pytest.raises(ValueError, match="do not hold a \\[20, 32\\] bfloat16 weight"):
        native.gemm_panels_bf16(torch.randn(2, 32).bfloat16(), native.pack_panels(
            weight.float()), 20)
    with pytest.raises(ValueError, match="out must be bfloat16 \\[2, 20\\]"):
        native.gemm_panels_bf16(torch.randn(2, 32).bfloat16(), panels, 20,
                                out=torch.empty(2, 20))
    with pytest.raises(ValueError, match="bfloat16 CPU weight"):
        native.pack_panels_bf16(weight.float())


@pytest.mark.skipif(not native.gemm_bf16_pairs(), reason="no AVX512-BF16 pairs kernel here")
def test_pairs_layout_holds_each_pair_of_k_per_column():
    """With K even the panels hold (W[c][2q], W[c][2q + 1]) for each column
    in turn; with K odd they keep the widening layout (and still multiply
    right: the reference test above covers K = 7 and 129)."""
    weight = torch.randn(21, 10).bfloat16()
    panels = native.pack_panels_bf16(weight).view(2, 5, 16, 2)
    for c in range(21):
        for q in range(5):
            for t in range(2):
                assert panels[c // 16, q, c % 16, t] == weight[c, 2 * q + t]
    assert not panels[1, :, 5:].any()  # columns past N are zero

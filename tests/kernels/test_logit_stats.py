"""`kernels.dispatch.logit_stats` (the sampler's argmax, max and log-sum-exp
per row): the native kernel and the torch reference against a float64
computation written out per row, on fresh random logits, ties, NaN, -inf
and +inf rows, vocabularies around the kernel's vector and block widths, and
strided rows."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import dispatch, native

BACKENDS = ["torch", pytest.param("auto", marks=pytest.mark.skipif(
    native.library() is None, reason="no C compiler: native kernels unavailable"))]


def _expected(row: list[float]) -> tuple[int, float, float]:
    """First index of the max (first NaN if any), the max, log sum exp(x - max)."""
    nans = [j for j, v in enumerate(row) if math.isnan(v)]
    if nans:
        return nans[0], math.nan, math.nan
    top = max(row)
    index = row.index(top)
    if math.isinf(top):
        return index, top, math.nan
    return index, top, math.log(math.fsum(math.exp(v - top) for v in row))


def _check(x: torch.Tensor, backend: str) -> None:
    argmax, top, logsum = dispatch.logit_stats(x, backend=backend)
    assert argmax.dtype == torch.int64 and top.dtype == logsum.dtype == torch.float32
    for i, row in enumerate(x.double().tolist()):
        index, expected_top, expected_sum = _expected(row)
        assert argmax[i].item() == index, (i, row)
        if math.isnan(expected_top):
            assert math.isnan(top[i].item())
        else:
            assert top[i].item() == expected_top
        if math.isnan(expected_sum):
            assert math.isnan(logsum[i].item())
        else:
            assert logsum[i].item() == pytest.approx(expected_sum, rel=2e-6, abs=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 31, 33, 511, 512, 513, 1000, 4099])
def test_random_rows_match_float64(vocab: int, backend: str) -> None:
    gen = torch.Generator().manual_seed(vocab)
    _check(torch.randn((5, vocab), generator=gen) * 6, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_real_vocabulary_keeps_float32_precision(backend: str) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn((3, 49152), generator=gen) * 4
    x[1] = torch.randn(49152, generator=gen) * 0.01  # nearly flat: logsum ~ log(49152)
    _check(x, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_nan_and_infinities(backend: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((7, 100), generator=gen)
    x[0, 40] = x[0, 56] = x[0, 72] = x[0, 90] = 50.0  # ties, three in one lane: the first wins
    x[1, 3] = x[1, 99] = 50.0                    # one tie in a vector, one in the tail
    x[2, 20] = math.nan                          # NaN: its index, and NaN
    x[2, 5] = math.nan
    x[3] = -math.inf                             # all -inf: index 0, NaN logsum
    x[4] = -math.inf                             # a masked row with one allowed token
    x[4, 99] = 2.0
    x[5, 97] = math.inf                          # +inf max: NaN logsum, as log_softmax
    x[6, :50] = -math.inf                        # half masked
    _check(x, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_and_empty(backend: str) -> None:
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn((4, 300), generator=gen)
    _check(wide[:, :257], backend)
    argmax, top, logsum = dispatch.logit_stats(torch.empty((0, 10)), backend=backend)
    assert argmax.shape == top.shape == logsum.shape == (0,)


@pytest.mark.skipif(native.library() is None, reason="no C compiler")
def test_native_results_do_not_depend_on_threads() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((9, 49152), generator=gen) * 3
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(native.logit_stats(x, logsum=True))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_refuses_what_it_does_not_take() -> None:
    with pytest.raises(ValueError, match="float32"):
        dispatch.logit_stats(torch.zeros((2, 3), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[n, V\]"):
        dispatch.logit_stats(torch.zeros(3))

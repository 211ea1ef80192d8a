"""Triton RMSNorm (interpreter on CPU) against the torch reference.

Odd hidden sizes (not a power of two, under and over the minimum tile),
one row and many rows, strided (non-contiguous) rows, weights in another
dtype, with and without the fused residual add. Outputs are NaN-poisoned.
"""

from __future__ import annotations

# Triton's CPU interpreter is written on numpy (a test extra, see docs/kernels.md).
import numpy  # noqa: F401  the interpreter needs it: a test dependency, fails rather than skips
import pytest
import torch

from kernels import reference  # noqa: E402
from kernels.norm import all_rms_norm_configs, rms_norm_config, rms_norm_triton  # noqa: E402
from tests.kernels.cases import DTYPE_IDS, DTYPES, assert_close, generator, randn  # noqa: E402

CASES = {
    # name: (num_tokens, hidden, weight_dtype or None for x.dtype, strided rows)
    "one_row": (1, 64, None, False),
    "odd_hidden": (13, 200, None, False),
    "wide_strided": (5, 1000, None, True),
    "fp32_weight": (7, 96, torch.float32, False),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_rms_norm_matches_reference(name, dtype, with_residual):
    num_tokens, hidden, weight_dtype, strided = CASES[name]
    gen = generator(list(CASES).index(name) * 10 + DTYPES.index(dtype) * 2 + with_residual)
    width = hidden + 24 if strided else hidden
    x = randn((num_tokens, width), dtype, gen)[:, :hidden]
    weight = randn((hidden,), weight_dtype or dtype, gen)
    residual = randn((num_tokens, hidden), dtype, gen) if with_residual else None
    out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype)
    residual_out = torch.full_like(out, float("nan")) if with_residual else None
    got = rms_norm_triton(x, weight, 1e-5, residual, out=out, residual_out=residual_out)
    expected = reference.rms_norm_reference(x, weight, 1e-5, residual)
    if with_residual:
        assert got[0] is out and got[1] is residual_out
        assert_close(out, expected[0])
        assert torch.equal(residual_out, expected[1])  # same rounding of x + residual
    else:
        assert got is out
        assert_close(out, expected)


def test_rms_norm_config_choice():
    assert rms_norm_config(torch.float16, torch.float16, 200, False).block_h == 256
    assert rms_norm_config(torch.float16, torch.float16, 4096, True).block_h == 4096
    assert rms_norm_config(torch.bfloat16, torch.float32, 8193, True).num_warps == 16
    assert rms_norm_config(torch.float32, torch.float32, 1000, False).num_warps == 4
    assert rms_norm_config(torch.float16, torch.float16, 4096, False).num_warps == 8
    with pytest.raises(ValueError, match="hidden 16385 outside 1..16384"):
        rms_norm_config(torch.float16, torch.float16, 16385, False)
    assert len(all_rms_norm_configs()) == 3 * 3 * 7 * 2

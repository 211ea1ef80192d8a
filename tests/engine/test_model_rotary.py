"""engine.layers.rotary: inverse frequencies (plain and Llama 3 scaled)
against hand-computed values, and the cos/sin cache layout the kernels read."""

from __future__ import annotations

import math

import pytest
import torch

from engine.layers.rotary import build_cos_sin_cache, rope_inv_freq
from engine.model_config import RopeScaling

# factor 8, bands: wavelength < 256/4 = 64 kept, > 256/1 = 256 divided by 8,
# between blended.
SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=256)


def test_plain_inv_freq() -> None:
    # theta ** (-2i/8) for i = 0..3 with theta = 10000: 1, 0.1, 0.01, 0.001
    got = rope_inv_freq(8, 10000.0)
    torch.testing.assert_close(got, torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64))


def test_llama3_inv_freq_all_three_bands() -> None:
    got = rope_inv_freq(16, 10000.0, SCALING)
    # plain: 10000 ** (-i/8), i = 0..7
    # i=0: 1.0         wavelen 6.28   < 64  -> kept
    # i=1: 0.3162278   wavelen 19.87  < 64  -> kept
    # i=2: 0.1         wavelen 62.83  < 64  -> kept
    # i=3: 0.0316228   wavelen 198.69 in [64, 256] -> smooth = (256/198.69 - 1)/3
    #      = 0.0961426; (1 - smooth) * f / 8 + smooth * f = 0.00661311
    # i>=4: wavelen > 256 -> f / 8: 0.00125, 0.000395285, 0.000125, 0.0000395285
    want = torch.tensor([1.0, 0.31622777, 0.1, 0.0066131063, 0.00125, 0.00039528470,
                         0.000125, 0.000039528470], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=0)


def test_cos_sin_cache_layout() -> None:
    cache = build_cos_sin_cache(16, 8, 10000.0)
    assert cache.shape == (16, 8) and cache.dtype == torch.float32
    # row = position 3: cos(3 * f) for f in inv_freq, then sin(3 * f)
    assert cache[3, 1].item() == pytest.approx(math.cos(0.3), abs=1e-7)
    assert cache[3, 5].item() == pytest.approx(math.sin(0.3), abs=1e-7)
    assert cache[0].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_rejects_odd_rotary_dim() -> None:
    with pytest.raises(ValueError, match="rotary_dim must be a positive even number, got 7"):
        rope_inv_freq(7, 10000.0)

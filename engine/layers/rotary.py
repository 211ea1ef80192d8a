"""Rotary position embedding tables (neox style), including Llama 3 scaling.

Called once by `LlamaForCausalLM.__init__` to build the cos/sin cache that
every layer passes to `kernels.rotary_embedding`; pure functions, no state.
"""

from __future__ import annotations

import math

import torch

from engine.model_config import RopeScaling


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in float64.

    Plain RoPE: inv_freq[i] = theta ** (-2i / rotary_dim). With Llama 3
    scaling, low frequencies (wavelength longer than
    original_max_position_embeddings / low_freq_factor) are divided by
    `factor`, high frequencies (wavelength shorter than
    original / high_freq_factor) are kept, and the band between is blended
    linearly in original / wavelength.
    """
    if rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    original = scaling.original_max_position_embeddings
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def build_cos_sin_cache(
    max_positions: int, rotary_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """The table `kernels.rotary_embedding` reads: [max_positions, rotary_dim]
    float32, cos(pos * inv_freq) in the first half of each row and
    sin(pos * inv_freq) in the second. Angles are computed in float64 so
    large positions keep their precision before the cast."""
    if max_positions <= 0:
        raise ValueError(f"max_positions must be > 0, got {max_positions}")
    inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
    positions = torch.arange(max_positions, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32)

"""Rotary position embedding tables (neox style), including Llama 3 scaling,
LongRoPE and partial rotary.

Called once by `LlamaForCausalLM.__init__` to build the cos/sin cache that
every layer passes to `kernels.rotary_embedding` (`cos_sin_cache_for`), and
by the loader for the head-dim order of partial rotary models
(`partial_rotary_order`); pure functions, no state.

Partial rotary (Phi-3's `partial_rotary_factor`): transformers rotates the
first R of each head's D dims, pairing dim i with i + R/2, and passes the
rest through. The kernels rotate whole heads, pairing i with i + D/2. So the
loader permutes each q and k head's dims (`partial_rotary_order`: the
rotated pairs land on (i, i + D/2) for i < R/2, the passed dims fill the
rest of both halves) and the table's columns R/2..D/2 hold cos 1, sin 0,
which leaves those dims exactly as they are. q.k is the same sum under one
permutation of both, so attention is unchanged; v and o_proj are not
permuted. (The KV cache then holds keys in the permuted order, on every
pod alike.)
"""

from __future__ import annotations

import math

import torch

from engine.model_config import ModelConfig, RopeScaling
from engine.model_variants import LongRopeScaling


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


def partial_rotary_order(head_dim: int, rotary_dim: int) -> list[int]:
    """Each q/k head's dims in the order the kernels rotate them (see the
    module docstring): new dim j holds checkpoint dim order[j]."""
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2 or head_dim % 2:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_dim "
                         f"{head_dim}], head_dim even")
    half_rot, half_pass = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(half_rot)) + list(range(rotary_dim, rotary_dim + half_pass))
    second = (list(range(half_rot, rotary_dim))
              + list(range(rotary_dim + half_pass, head_dim)))
    return first + second


def cos_sin_cache_for(config: ModelConfig) -> torch.Tensor:
    """The model's table [positions, head_dim] float32 for `kernels.rotary_embedding`.

    LongRoPE: inv_freq / short_factor and cos, sin scaled by its
    attention_factor, for the positions below original_max_position_embeddings
    (the engine runs no longer context, `ModelConfig.context_limit`).
    Partial rotary: columns past rotary_dim / 2 of each half are cos 1, sin 0
    (identity).
    """
    scaling = config.rope_scaling
    positions = config.max_position_embeddings
    if isinstance(scaling, LongRopeScaling):
        positions = min(positions, scaling.original_max_position_embeddings)
        inv_freq = rope_inv_freq(config.rotary_dim, config.rope_theta) / torch.tensor(
            scaling.short_factor, dtype=torch.float64)
        angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
        cos, sin = angles.cos() * scaling.attention_factor, angles.sin() * scaling.attention_factor
    else:
        table = build_cos_sin_cache(positions, config.rotary_dim, config.rope_theta, scaling)
        cos, sin = table.double().chunk(2, dim=-1)
    identity = (config.head_dim - config.rotary_dim) // 2
    if identity:
        cos = torch.cat([cos, cos.new_ones(positions, identity)], dim=-1)
        sin = torch.cat([sin, sin.new_zeros(positions, identity)], dim=-1)
    return torch.cat([cos, sin], dim=-1).to(torch.float32)

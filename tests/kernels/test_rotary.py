"""Triton neox RoPE (interpreter on CPU) against the torch reference.

One token, odd token counts, head counts not a multiple of the head tile,
repeated and unsorted positions, strided q (a slice of a fused qkv tensor),
every head dim (96: halves of 48 in a masked 64-lane tile).
Outputs are NaN-poisoned; inputs must come back untouched.
"""

from __future__ import annotations

# Triton's CPU interpreter is written on numpy (a test extra, see docs/kernels.md).
import numpy  # noqa: F401  the interpreter needs it: a test dependency, fails rather than skips
import pytest
import torch

from kernels import reference  # noqa: E402
from kernels.rotary import all_rotary_configs, rotary_embedding_triton  # noqa: E402
from tests.kernels.cases import DTYPE_IDS, DTYPES, assert_close, generator, randn, rope_cache  # noqa: E402

CASES = {
    # name: (num_tokens, q_heads, kv_heads, head_dim)
    "one_token": (1, 1, 1, 64),
    "odd_heads": (7, 5, 3, 128),
    "gqa": (11, 8, 2, 64),
    "head_dim_96": (7, 6, 2, 96),
    "head_dim_256": (5, 4, 1, 256),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_rotary_matches_reference(name, dtype):
    num_tokens, q_heads, kv_heads, head_dim = CASES[name]
    gen = generator(list(CASES).index(name) * 3 + DTYPES.index(dtype))
    positions = torch.randint(0, 300, (num_tokens,), generator=gen, dtype=torch.int64)
    # q and k as views into one fused projection output, as the model produces them.
    qkv = randn((num_tokens, q_heads + 2 * kv_heads, head_dim), dtype, gen)
    q, k = qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads]
    before = qkv.clone()
    cache = rope_cache(300, head_dim)
    # Outputs are views of wider NaN buffers: the gaps catch writes past a head.
    q_wide = torch.full((num_tokens, q_heads, head_dim + 32), float("nan"), dtype=dtype)
    k_wide = torch.full((num_tokens, kv_heads, head_dim + 32), float("nan"), dtype=dtype)
    q_out, k_out = q_wide[..., :head_dim], k_wide[..., :head_dim]
    got_q, got_k = rotary_embedding_triton(positions, q, k, cache, q_out=q_out, k_out=k_out)
    assert got_q is q_out and got_k is k_out
    assert torch.isnan(q_wide[..., head_dim:]).all() and torch.isnan(k_wide[..., head_dim:]).all()
    want_q, want_k = reference.rotary_embedding_reference(positions, q, k, cache)
    assert_close(q_out, want_q)
    assert_close(k_out, want_k)
    assert torch.equal(qkv, before)


def test_rotary_configs():
    assert len(all_rotary_configs()) == 12
    assert {c.head_dim: c.half_pad for c in all_rotary_configs()} == {
        64: 32, 96: 64, 128: 64, 256: 128}

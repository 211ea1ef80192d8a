"""The torch references against independent, straightforward computations.

The kernel tests trust kernels.reference, so it is checked here first: paged
attention against dense attention on K/V gathered token by token with an
explicit float64 softmax; inject/extract against per-token Python loops;
RMSNorm against the formula in float64; RoPE against complex rotation by
angles computed from positions (not read from the cache).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference
from tests.kernels.cases import (
    DTYPE_IDS,
    DTYPES,
    assert_close,
    generator,
    make_paged_case,
    randn,
    rope_angles,
    rope_cache,
)


def dense_decode_attention(case, sliding_window):
    """Per sequence, per query head: gather K/V token by token, explicit softmax in float64."""
    q, kv, tables, lens = case.q, case.kv_cache, case.block_tables, case.context_lens
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv.shape[2], kv.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        first = 0 if sliding_window is None else max(0, n - sliding_window)
        rows = [(int(tables[b, p // block_size]), p % block_size) for p in range(first, n)]
        if not rows:
            continue
        for h in range(num_q_heads):
            keys = torch.stack([kv[0, blk, off, h // group] for blk, off in rows]).double()
            values = torch.stack([kv[1, blk, off, h // group] for blk, off in rows]).double()
            scores = keys @ q[b, h].double() * case.scale
            weights = torch.exp(scores - scores.max())
            out[b, h] = (weights / weights.sum()) @ values
    return out.to(q.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "lens,window,block_size,kv_heads,group,head_dim",
    [
        ([1], None, 16, 1, 1, 64),
        ([17, 1, 40, 5], None, 16, 2, 4, 64),
        ([70, 3], 9, 32, 1, 3, 64),
        ([130, 0, 64], 64, 64, 2, 2, 64),
        ([33, 2], None, 16, 2, 3, 96),
        ([40, 0, 17], 20, 32, 1, 4, 256),
    ],
)
def test_paged_decode_attention_reference_matches_dense(
    dtype, lens, window, block_size, kv_heads, group, head_dim
):
    case = make_paged_case(
        sum(lens) + block_size, lens, dtype=dtype, num_kv_heads=kv_heads, group=group,
        head_dim=head_dim, block_size=block_size,
    )
    got = reference.paged_decode_attention_reference(
        case.q, case.kv_cache, case.block_tables, case.context_lens,
        scale=case.scale, sliding_window=window,
    )
    expected = dense_decode_attention(case, window)
    assert_close(got, expected)
    if 0 in lens:
        assert torch.equal(got[lens.index(0)], torch.zeros_like(got[0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_inject_extract_reference_match_loops(dtype):
    gen = generator(11)
    kv = randn((2, 5, 16, 3, 64), dtype, gen)
    original = kv.clone()
    slots = torch.tensor([17, 3, -1, 79, 40, 41], dtype=torch.int64)
    src = randn((2, 6, 3, 64), dtype, gen)
    reference.inject_kv_reference(kv, src, slots)
    expected = original.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[:, slot // 16, slot % 16] = src[:, t]
    assert torch.equal(kv, expected)
    out = torch.full((2, 6, 3, 64), float("nan"), dtype=dtype)
    got = reference.extract_kv_reference(kv, slots, out)
    assert got is out
    for t, slot in enumerate(slots.tolist()):
        want = src[:, t] if slot >= 0 else torch.zeros_like(src[:, t])
        assert torch.equal(out[:, t], want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_reference_matches_formula(dtype, with_residual):
    gen = generator(5)
    x, weight = randn((7, 96), dtype, gen), randn((96,), dtype, gen)
    residual = randn((7, 96), dtype, gen) if with_residual else None
    got = reference.rms_norm_reference(x, weight, 1e-6, residual)
    r = x if residual is None else (x.double() + residual.double()).to(dtype)
    rd = r.double()
    expected = (rd / torch.sqrt((rd * rd).sum(dim=1, keepdim=True) / 96 + 1e-6)
                * weight.double()).to(dtype)
    if with_residual:
        y, r_got = got
        assert torch.equal(r_got, r)
        assert_close(y, expected)
    else:
        assert_close(got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_rotary_reference_matches_complex_rotation(dtype, head_dim):
    gen = generator(head_dim)
    positions = torch.tensor([0, 5, 1023, 77, 5], dtype=torch.int64)
    q, k = randn((5, 4, head_dim), dtype, gen), randn((5, 2, head_dim), dtype, gen)
    q_in, k_in = q.clone(), k.clone()
    got_q, got_k = reference.rotary_embedding_reference(
        positions, q, k, rope_cache(1024, head_dim)
    )
    assert torch.equal(q, q_in) and torch.equal(k, k_in)
    rotation = torch.polar(torch.ones(5, head_dim // 2, dtype=torch.float64),
                           rope_angles(positions, head_dim))[:, None, :]
    half = head_dim // 2
    for got, x in ((got_q, q), (got_k, k)):
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rotation
        assert_close(got, torch.cat((z.real, z.imag), dim=-1).to(dtype))
    assert math.isclose(float(rope_cache(2, 64)[1, 0]), math.cos(1.0), rel_tol=1e-6)

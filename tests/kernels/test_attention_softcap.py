"""Attention logit soft-capping (`softcap`, Gemma 2) in every attention backend.

The references are checked against float64 loops written out here; the
native CPU kernel, the Triton kernels (interpreter on CPU) and the fused
decode op against the references, on fresh random inputs with caps small
enough to bend most scores (so an ignored cap fails), with and without a
sliding window.
"""

from __future__ import annotations

import math

# Triton's CPU interpreter is written on numpy (a test extra, see docs/kernels.md).
import numpy  # noqa: F401  the interpreter needs it: a test dependency, fails rather than skips
import pytest
import torch

import kernels
from kernels import native, reference
from kernels.paged_attention import paged_decode_attention_triton
from kernels.prefill_attention import paged_prefill_attention_triton
from tests.kernels.cases import (
    DTYPE_IDS,
    DTYPES,
    assert_close,
    generator,
    make_paged_case,
    randn,
    rope_cache,
)

# name: (block_size, head_dim, kv_heads, group, [(context_len, qlen)], window, softcap)
CASES = {
    "cap_only": (16, 64, 2, 4, [(40, 23), (17, 17), (5, 1)], None, 1.5),
    "cap_and_window": (32, 128, 1, 2, [(150, 37), (9, 0), (66, 66)], 20, 0.7),
    "cap_wide_group": (64, 64, 1, 8, [(130, 5)], 8, 3.0),
    # Gemma 2's head dim (its 2B and 9B checkpoints), and Phi-3-mini's padded 96.
    "cap_head_dim_256": (16, 256, 2, 2, [(40, 9), (33, 33), (5, 1)], 16, 1.0),
    "cap_head_dim_96": (32, 96, 1, 3, [(70, 6)], None, 2.0),
}


def _case(name: str, dtype: torch.dtype):
    block_size, head_dim, kv_heads, group, seqs, window, softcap = CASES[name]
    seed = list(CASES).index(name) * 11 + DTYPES.index(dtype)
    paged = make_paged_case(seed, [n for n, _ in seqs], dtype=dtype, num_kv_heads=kv_heads,
                            group=group, head_dim=head_dim, block_size=block_size)
    # Scores of std ~3 (scale 1/sqrt(D) on unit normals gives ~1): well past the caps.
    q = randn((sum(n for _, n in seqs), kv_heads * group, head_dim), dtype,
              generator(seed + 500)) * 3
    starts = [0]
    for _, qlen in seqs:
        starts.append(starts[-1] + qlen)
    return paged, q.to(dtype), torch.tensor(starts, dtype=torch.int32), window, softcap


def _float64_loop(q, paged, starts, window, softcap):
    kv, tables = paged.kv_cache, paged.block_tables
    block_size, group = kv.shape[2], q.shape[1] // kv.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for seq, context_len in enumerate(paged.context_lens.tolist()):
        begin, end = int(starts[seq]), int(starts[seq + 1])
        for row in range(begin, end):
            pos = context_len - (end - row)
            first = 0 if window is None else max(0, pos - window + 1)
            where = [(int(tables[seq, p // block_size]), p % block_size)
                     for p in range(first, pos + 1)]
            for h in range(q.shape[1]):
                keys = torch.stack([kv[0, b, o, h // group] for b, o in where]).double()
                values = torch.stack([kv[1, b, o, h // group] for b, o in where]).double()
                scores = keys @ q[row, h].double() * paged.scale
                scores = softcap * torch.tanh(scores / softcap)
                weights = torch.exp(scores - scores.max())
                out[row, h] = (weights / weights.sum()) @ values
    return out.to(q.dtype)


def _decode_rows(q, starts, paged):
    """One decode query per sequence (its last new token; sequences with none dropped)."""
    rows = [int(starts[s + 1]) - 1 for s in range(len(starts) - 1) if starts[s + 1] > starts[s]]
    keep = [s for s in range(len(starts) - 1) if starts[s + 1] > starts[s]]
    return (q[rows].contiguous(), paged.block_tables[keep], paged.context_lens[keep],
            torch.tensor([0, *range(1, len(rows) + 1)], dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_references_match_float64_loop(name, dtype):
    paged, q, starts, window, softcap = _case(name, dtype)
    got = reference.paged_prefill_attention_reference(
        q, paged.kv_cache, paged.block_tables, starts, paged.context_lens,
        scale=paged.scale, sliding_window=window, softcap=softcap)
    assert_close(got, _float64_loop(q, paged, starts, window, softcap))
    uncapped = reference.paged_prefill_attention_reference(
        q, paged.kv_cache, paged.block_tables, starts, paged.context_lens,
        scale=paged.scale, sliding_window=window)
    assert (got.float() - uncapped.float()).abs().max() > 0.05  # the cap matters here
    dq, tables, lens, dstarts = _decode_rows(q, starts, paged)
    decode = reference.paged_decode_attention_reference(
        dq, paged.kv_cache, tables, lens, scale=paged.scale, sliding_window=window,
        softcap=softcap)
    one_row = type(paged)(dq, paged.kv_cache, tables, lens, paged.scale)
    assert_close(decode, _float64_loop(dq, one_row, dstarts, window, softcap))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernels_match_reference(name, dtype):
    paged, q, starts, window, softcap = _case(name, dtype)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention_triton(q, paged.kv_cache, paged.block_tables, starts,
                                   paged.context_lens, scale=paged.scale,
                                   sliding_window=window, softcap=softcap, out=out)
    assert_close(out, reference.paged_prefill_attention_reference(
        q, paged.kv_cache, paged.block_tables, starts, paged.context_lens,
        scale=paged.scale, sliding_window=window, softcap=softcap))
    dq, tables, lens, _ = _decode_rows(q, starts, paged)
    for splits in (1, 3):
        got = paged_decode_attention_triton(dq, paged.kv_cache, tables, lens, scale=paged.scale,
                                            sliding_window=window, softcap=softcap,
                                            num_splits=splits)
        assert_close(got, reference.paged_decode_attention_reference(
            dq, paged.kv_cache, tables, lens, scale=paged.scale, sliding_window=window,
            softcap=softcap))


@pytest.mark.skipif(native.library() is None, reason="native CPU kernels did not build")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_native_decode_matches_reference(name, dtype):
    paged, q, starts, window, softcap = _case(name, dtype)
    dq, tables, lens, _ = _decode_rows(q, starts, paged)
    got = native.paged_decode_attention(dq, paged.kv_cache, tables, lens, scale=paged.scale,
                                        sliding_window=window, softcap=softcap)
    assert_close(got, reference.paged_decode_attention_reference(
        dq, paged.kv_cache, tables, lens, scale=paged.scale, sliding_window=window,
        softcap=softcap))


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_decode_qkv_attention_soft_caps(backend, dtype):
    """The fused decode op (native on CPU under auto; composed otherwise)
    against split + RoPE + inject + the decode reference."""
    block_size, head_dim, kv_heads, group, softcap, window = 16, 64, 2, 3, 1.0, 24
    lens = [40, 1, 33, 17]
    case = make_paged_case(77 + DTYPES.index(dtype), lens, dtype=dtype, num_kv_heads=kv_heads,
                           group=group, head_dim=head_dim, block_size=block_size)
    width = (kv_heads * group + 2 * kv_heads) * head_dim
    qkv = randn((len(lens), width), dtype, generator(78)) * 3
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([int(case.block_tables[b, (n - 1) // block_size]) * block_size
                          + (n - 1) % block_size for b, n in enumerate(lens)])
    cos_sin = rope_cache(128, head_dim)
    expected_cache = case.kv_cache.clone()
    q, k, v = qkv.split([kv_heads * group * head_dim, kv_heads * head_dim,
                         kv_heads * head_dim], dim=-1)
    q, k = kernels.rotary_embedding(positions, q.reshape(len(lens), -1, head_dim),
                                    k.reshape(len(lens), kv_heads, head_dim), cos_sin,
                                    backend="torch")
    kernels.inject_kv(expected_cache, torch.stack((k, v.reshape(len(lens), kv_heads, head_dim))),
                      slots, backend="torch")
    expected = reference.paged_decode_attention_reference(
        q, expected_cache, case.block_tables, case.context_lens, scale=case.scale,
        sliding_window=window, softcap=softcap)
    cache = case.kv_cache.clone()
    got = kernels.decode_qkv_attention(qkv.clone(), positions, cos_sin, cache, slots,
                                       case.block_tables, case.context_lens, scale=case.scale,
                                       sliding_window=window, softcap=softcap, backend=backend)
    assert_close(got, expected)
    assert_close(cache, expected_cache)


def test_softcap_must_be_positive():
    case = make_paged_case(5, [4], dtype=torch.float32, num_kv_heads=1, group=1, head_dim=64,
                           block_size=16)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="softcap must be > 0 or None"):
            kernels.paged_decode_attention(case.q, case.kv_cache, case.block_tables,
                                           case.context_lens, scale=case.scale, softcap=bad)

"""Paged prefill attention: the reference against float64 loops, the Triton kernel
(interpreter on CPU) against the reference.

Sequences mix a cached prefix with new tokens (qlen < context_len), a whole
prompt (qlen == context_len), one new token, an empty slot (qlen 0), token
counts not a multiple of the query tile, sliding windows, GQA groups of
several padded widths, every head dim (96 padded and masked; 256 with its
smaller programs and groups sliced over several) and all three dtypes.
Outputs are NaN-poisoned.
"""

from __future__ import annotations

# Triton's CPU interpreter is written on numpy (a test extra, see docs/kernels.md).
import numpy  # noqa: F401  the interpreter needs it: a test dependency, fails rather than skips
import pytest
import torch

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.prefill_attention import (  # noqa: E402
    all_prefill_configs,
    paged_prefill_attention_triton,
    prefill_config,
)
from tests.kernels.cases import (  # noqa: E402
    DTYPE_IDS,
    DTYPES,
    assert_close,
    generator,
    make_paged_case,
    randn,
)

CASES = {
    # name: (block_size, head_dim, kv_heads, group, [(context_len, qlen)], window)
    "prefix_plus_chunk": (16, 64, 2, 4, [(40, 23), (17, 17), (5, 1)], None),
    "whole_prompts": (32, 128, 1, 1, [(70, 70), (3, 3)], None),
    "window_and_empty": (64, 64, 1, 8, [(150, 37), (9, 0), (66, 66)], 20),
    "wide_group": (128, 128, 1, 20, [(130, 5)], None),
    "head_dim_96": (16, 96, 2, 3, [(40, 23), (17, 17), (9, 0)], None),
    "head_dim_96_window": (32, 96, 1, 8, [(70, 70)], 20),
    "head_dim_256": (32, 256, 2, 2, [(70, 40), (5, 1), (20, 20)], 20),
    "head_dim_256_one_head": (16, 256, 2, 1, [(50, 37)], None),
    "head_dim_256_group_20": (16, 256, 1, 20, [(30, 9)], None),
    "head_dim_256_group_40": (64, 256, 1, 40, [(12, 3)], 5),
}


def _case(seed, dtype, block_size, head_dim, kv_heads, group, seqs):
    paged = make_paged_case(seed, [n for n, _ in seqs], dtype=dtype, num_kv_heads=kv_heads,
                            group=group, head_dim=head_dim, block_size=block_size)
    total = sum(qlen for _, qlen in seqs)
    q = randn((total, kv_heads * group, head_dim), dtype, generator(seed + 1000))
    starts = [0]
    for _, qlen in seqs:
        starts.append(starts[-1] + qlen)
    return paged, q, torch.tensor(starts, dtype=torch.int32)


def _float64_loop(q, paged, starts, window):
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
                weights = torch.exp(scores - scores.max())
                out[row, h] = (weights / weights.sum()) @ values
    return out.to(q.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ["prefix_plus_chunk", "window_and_empty", "head_dim_96",
                                  "head_dim_256"])
def test_prefill_reference_matches_float64_loop(name, dtype):
    block_size, head_dim, kv_heads, group, seqs, window = CASES[name]
    paged, q, starts = _case(len(name), dtype, block_size, head_dim, kv_heads, group, seqs)
    got = reference.paged_prefill_attention_reference(
        q, paged.kv_cache, paged.block_tables, starts, paged.context_lens,
        scale=paged.scale, sliding_window=window)
    assert_close(got, _float64_loop(q, paged, starts, window))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_kernel_matches_reference(name, dtype):
    block_size, head_dim, kv_heads, group, seqs, window = CASES[name]
    paged, q, starts = _case(list(CASES).index(name) * 3 + DTYPES.index(dtype), dtype,
                             block_size, head_dim, kv_heads, group, seqs)
    # A view of a wider NaN buffer: the gap catches writes past a head.
    wide = torch.full((*q.shape[:2], head_dim + 32), float("nan"), dtype=dtype)
    out = wide[..., :head_dim]
    got = paged_prefill_attention_triton(
        q, paged.kv_cache, paged.block_tables, starts, paged.context_lens,
        scale=paged.scale, sliding_window=window, out=out)
    assert got is out
    assert torch.isnan(wide[..., head_dim:]).all()
    expected = reference.paged_prefill_attention_reference(
        q, paged.kv_cache, paged.block_tables, starts, paged.context_lens,
        scale=paged.scale, sliding_window=window)
    assert_close(out, expected)


def test_prefill_rejects_inconsistent_layout():
    paged, q, starts = _case(3, torch.float32, 16, 64, 1, 2, [(10, 4), (6, 6)])
    args = (paged.kv_cache, paged.block_tables)
    with pytest.raises(ValueError, match="query_start_loc must run from 0 to 10"):
        kernels.paged_prefill_attention(q, *args, starts + 1, paged.context_lens,
                                        scale=paged.scale)
    with pytest.raises(ValueError, match="sequence 0: 4 new tokens for context_len 3"):
        kernels.paged_prefill_attention(q, *args, starts, torch.tensor([3, 6], dtype=torch.int32),
                                        scale=paged.scale)
    with pytest.raises(ValueError, match="query_start_loc has 2 entries for 2 sequences"):
        kernels.paged_prefill_attention(q, *args, starts[:2], paged.context_lens,
                                        scale=paged.scale)


def test_prefill_configs():
    assert prefill_config(torch.bfloat16, 128, 16, 8).block_m == 8
    assert prefill_config(torch.bfloat16, 128, 16, 1).block_m == 64
    assert prefill_config(torch.float32, 128, 16, 20).group_pad == 32
    assert len(set(all_prefill_configs())) == 3 * 4 * 5 * 7
    # 96 runs in the 128-wide tiles, with 128's choices.
    assert prefill_config(torch.float32, 96, 16, 3).block_d == 128
    assert prefill_config(torch.float32, 96, 16, 3).num_warps == 16
    # 256: 32 rows in half precision, 16 in fp32; wider groups are sliced.
    assert prefill_config(torch.bfloat16, 256, 16, 2).block_m == 16
    assert prefill_config(torch.bfloat16, 256, 16, 1).tile_n == 16
    sliced = prefill_config(torch.float16, 256, 16, 40)
    assert (sliced.group_pad, sliced.head_slices, sliced.block_m) == (32, 2, 1)
    sliced = prefill_config(torch.float32, 256, 16, 20)
    assert (sliced.group_pad, sliced.head_slices, sliced.block_m) == (16, 2, 1)
    assert sliced.num_warps == 8 and prefill_config(torch.float32, 256, 16, 3).num_warps == 4
    assert prefill_config(torch.float32, 256, 16, 33).head_slices == 4

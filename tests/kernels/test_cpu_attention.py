"""kernels/cpu_attention.py (the CPU decode path of backend auto) against the torch reference."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from kernels.cpu_attention import paged_decode_attention_cpu
from tests.kernels.cases import DTYPE_IDS, DTYPES, assert_close, make_paged_case

CASES = {
    # name: (block_size, head_dim, kv_heads, group, context_lens, window)
    "one_token": (16, 64, 1, 1, [1], None),
    "many_short": (16, 128, 2, 4, [3, 1, 17, 16, 33, 9, 2, 5], None),
    "one_long": (256, 64, 1, 8, [700], None),
    "window": (32, 128, 2, 2, [100, 5, 64], 40),
    "padding_row": (64, 64, 1, 16, [130, 0], None),
    "wide_group_window": (128, 128, 1, 20, [129, 1], 128),
    "head_dim_96": (16, 96, 2, 3, [47, 16, 1, 0], None),
    "head_dim_256_window": (32, 256, 2, 2, [100, 5, 64], 40),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, dtype):
    block_size, head_dim, kv_heads, group, lens, window = CASES[name]
    case = make_paged_case(7 * len(lens) + len(name), lens, dtype=dtype,
                           num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                           block_size=block_size)
    expected = reference.paged_decode_attention_reference(
        case.q, case.kv_cache, case.block_tables, case.context_lens,
        scale=case.scale, sliding_window=window)
    got = paged_decode_attention_cpu(case.q, case.kv_cache, case.block_tables, case.context_lens,
                                     scale=case.scale, sliding_window=window)
    assert got.dtype == dtype and got.shape == case.q.shape
    assert_close(got, expected)
    assert not got.isnan().any()


def test_garbage_table_entries_past_the_context_are_never_read():
    case = make_paged_case(5, [20, 3], dtype=torch.float32, num_kv_heads=2, group=2,
                           head_dim=64, block_size=16)
    tables = case.block_tables.clone()
    tables[1, 1:] = 10**6  # past sequence 1's only block
    got = paged_decode_attention_cpu(case.q, case.kv_cache, tables, case.context_lens,
                                     scale=case.scale)
    expected = reference.paged_decode_attention_reference(
        case.q, case.kv_cache, case.block_tables, case.context_lens, scale=case.scale)
    assert_close(got, expected)


def test_dispatch_auto_on_cpu_without_native_kernels_takes_this_path(monkeypatch):
    case = make_paged_case(9, [5], dtype=torch.float32, num_kv_heads=1, group=1,
                           head_dim=64, block_size=16)
    called = []
    monkeypatch.setattr(kernels.dispatch.native, "supports", lambda q, cache: False)
    monkeypatch.setattr(kernels.dispatch, "paged_decode_attention_cpu",
                        lambda *a, **k: called.append("cpu") or case.q)
    monkeypatch.setattr(kernels.dispatch.reference, "paged_decode_attention_reference",
                        lambda *a, **k: called.append("reference") or case.q)
    args = (case.q, case.kv_cache, case.block_tables, case.context_lens)
    kernels.paged_decode_attention(*args, scale=case.scale)
    kernels.paged_decode_attention(*args, scale=case.scale, backend="torch")
    assert called == ["cpu", "reference"]

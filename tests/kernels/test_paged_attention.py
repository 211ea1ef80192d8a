"""Triton paged decode attention (interpreter on CPU) against the torch reference.

Cases cover one token, many short sequences, one long sequence split several
ways, sliding windows, a padding row (context 0), every block size, every
head dim (96: a padded, masked tile; 256, incl. a group sliced over two
programs in fp32), GQA groups of every padded width, and all three dtypes.
The output buffer is poisoned with NaN so an unwritten element fails the
test (and a write into the padding lanes of head dim 96 would land in the
next head's row, poisoned or compared).
"""

from __future__ import annotations

# Triton's CPU interpreter is written on numpy (a test extra, see docs/kernels.md).
import numpy  # noqa: F401  the interpreter needs it: a test dependency, fails rather than skips
import pytest
import torch

from kernels import reference  # noqa: E402
from kernels.paged_attention import (  # noqa: E402
    MAX_SPLITS,
    TARGET_PROGRAMS,
    all_decode_configs,
    decode_config,
    paged_decode_attention_triton,
    split_plan,
)
from tests.kernels.cases import DTYPE_IDS, DTYPES, assert_close, make_paged_case  # noqa: E402

CASES = {
    # name: (block_size, head_dim, kv_heads, group, context_lens, window, num_splits)
    "one_token": (16, 64, 1, 1, [1], None, None),
    "many_short": (16, 128, 2, 4, [3, 1, 17, 16, 33, 9, 2, 5], None, None),
    "one_long_split": (256, 64, 1, 8, [700], None, 3),
    "window_split": (32, 128, 2, 2, [100, 5, 64], 40, 2),
    "padding_row": (64, 64, 1, 16, [130, 0], None, None),
    "wide_group_window": (128, 128, 1, 20, [129, 1], 128, None),
    "head_dim_96": (16, 96, 2, 3, [3, 40, 17, 0], None, None),
    "head_dim_96_split_window": (32, 96, 1, 8, [300, 33], 100, 3),
    "head_dim_256": (16, 256, 2, 2, [33, 1, 70], None, None),
    "head_dim_256_split_window": (64, 256, 1, 4, [300, 0], 50, 2),
    "head_dim_256_group_40": (16, 256, 1, 40, [20, 5], None, 2),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_decode_attention_matches_reference(name, dtype):
    block_size, head_dim, kv_heads, group, lens, window, splits = CASES[name]
    case = make_paged_case(
        list(CASES).index(name) * 7 + DTYPES.index(dtype), lens, dtype=dtype,
        num_kv_heads=kv_heads, group=group, head_dim=head_dim, block_size=block_size,
    )
    # out is a view of a wider NaN buffer: its gap columns catch any write
    # past a head (the padding lanes of a head dim that is not a power of two).
    wide = torch.full((*case.q.shape[:2], head_dim + 32), float("nan"), dtype=dtype)
    out = wide[..., :head_dim]
    got = paged_decode_attention_triton(
        case.q, case.kv_cache, case.block_tables, case.context_lens,
        scale=case.scale, sliding_window=window, num_splits=splits, out=out,
    )
    assert got is out
    assert torch.isnan(wide[..., head_dim:]).all()
    expected = reference.paged_decode_attention_reference(
        case.q, case.kv_cache, case.block_tables, case.context_lens,
        scale=case.scale, sliding_window=window,
    )
    assert_close(got, expected)


def test_split_plan_fills_the_device_and_bounds_the_reduce():
    # 1 sequence x 1 KV head wants 512 splits; 4096 positions allow 16 of 256.
    assert split_plan(1, 1, 4096, 64) == (16, 256)
    # Short contexts never split below MIN_PARTITION positions.
    assert split_plan(1, 8, 300, 64) == (2, 192)
    # A full batch already fills the device: one split.
    assert split_plan(64, 8, 4096, 64) == (1, 4096)
    assert split_plan(16, 8, 32768, 32) == (4, 8192)
    # The reduce tile caps the split count.
    assert split_plan(1, 1, 1 << 20, 64)[0] == MAX_SPLITS
    assert TARGET_PROGRAMS == 512


def test_every_selected_config_is_one_the_aot_test_compiles():
    compiled = set(all_decode_configs())
    assert len(compiled) == 3 * 4 * 5 * 3
    for dtype in DTYPES:
        for group in (1, 2, 3, 7, 8, 16, 17, 32, 33, 64):
            for block_size in (16, 32, 64, 128, 256):
                for head_dim in (64, 96, 128, 256):
                    assert decode_config(dtype, head_dim, block_size, group) in compiled
    assert decode_config(torch.float16, 128, 16, 8).group_pad == 16
    assert decode_config(torch.float16, 128, 16, 40).group_pad == 64
    assert decode_config(torch.float32, 128, 16, 1).tile_n == 32
    assert decode_config(torch.float32, 128, 16, 64).num_warps == 16
    assert decode_config(torch.bfloat16, 128, 16, 64).tile_n == 64
    # 96 runs in the 128-wide tiles, with 128's choices.
    d96 = decode_config(torch.float32, 96, 16, 64)
    assert (d96.block_d, d96.tile_n, d96.num_warps) == (128, 32, 16)
    assert decode_config(torch.float16, 256, 16, 8).tile_n == 32
    assert decode_config(torch.float16, 256, 16, 64).tile_n == 16
    wide = decode_config(torch.float32, 256, 16, 40)
    assert (wide.group_pad, wide.head_slices, wide.tile_n) == (32, 2, 16)
    with pytest.raises(ValueError, match="GQA group 65 outside 1..64"):
        decode_config(torch.float16, 128, 16, 65)

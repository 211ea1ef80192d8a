"""Triton KV inject / extract (interpreter on CPU) against the torch reference.

The copies are bit-exact, so results are compared with torch.equal. Slot
mappings cover one token, a partial last block, several requests' slots
shuffled into one launch, padding slots (-1), a token range sliced out of a
larger landing buffer, and rows both under and over one copy chunk.
"""

from __future__ import annotations

# Triton's CPU interpreter is written on numpy (a test extra, see docs/kernels.md).
import numpy  # noqa: F401  the interpreter needs it: a test dependency, fails rather than skips
import pytest
import torch

from kernels import reference  # noqa: E402
from kernels.kv_copy import all_copy_configs, copy_config, extract_kv_triton, inject_kv_triton  # noqa: E402
from tests.kernels.cases import DTYPE_IDS, DTYPES, generator, randn  # noqa: E402

CASES = {
    # name: (num_blocks, block_size, kv_heads, head_dim, slots)
    "one_token": (3, 16, 1, 64, [21]),
    "partial_last_block": (4, 32, 2, 64, list(range(64, 64 + 45))),
    "many_requests_shuffled": (6, 16, 3, 128, [90, 5, 6, 7, 40, 41, 91, 0, 17, 95]),
    "padding_slots": (2, 64, 2, 128, [3, -1, 127, -1, 64]),
    "wide_rows": (2, 256, 16, 128, [511, 0, 300]),
    "head_dim_96": (4, 16, 3, 96, [5, -1, 63, 16, 17]),
    "head_dim_256": (3, 32, 2, 256, [95, 0, -1, 40]),
}


def _slots(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_inject_matches_reference(name, dtype):
    num_blocks, block_size, kv_heads, head_dim, slot_list = CASES[name]
    gen = generator(list(CASES).index(name) * 3 + DTYPES.index(dtype))
    cache = randn((2, num_blocks, block_size, kv_heads, head_dim), dtype, gen)
    # A landing buffer holding more tokens than this launch: inject a slice of it.
    landing = randn((2, len(slot_list) + 3, kv_heads, head_dim), dtype, gen)
    src = landing[:, 2 : 2 + len(slot_list)]
    expected = cache.clone()
    reference.inject_kv_reference(expected, src, _slots(slot_list))
    inject_kv_triton(cache, src, _slots(slot_list))
    assert torch.equal(cache, expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_extract_matches_reference(name, dtype):
    num_blocks, block_size, kv_heads, head_dim, slot_list = CASES[name]
    gen = generator(100 + list(CASES).index(name) * 3 + DTYPES.index(dtype))
    cache = randn((2, num_blocks, block_size, kv_heads, head_dim), dtype, gen)
    out = torch.full((2, len(slot_list), kv_heads, head_dim), float("nan"), dtype=dtype)
    got = extract_kv_triton(cache, _slots(slot_list), out)
    assert got is out
    assert not torch.isnan(out).any()
    assert torch.equal(out, reference.extract_kv_reference(cache, _slots(slot_list)))


def test_out_of_range_slot_is_skipped_not_written():
    gen = generator(7)
    cache = randn((2, 2, 16, 1, 64), torch.float32, gen)
    before = cache.clone()
    inject_kv_triton(cache, randn((2, 2, 1, 64), torch.float32, gen), _slots([32, 10_000]))
    assert torch.equal(cache, before)


def test_copy_config_choice():
    assert copy_config(torch.bfloat16, 128) == copy_config(torch.float16, 256)
    assert copy_config(torch.float32, 1024).bits == 32
    assert copy_config(torch.float16, 2048).chunk == 1024
    assert set(all_copy_configs()) == {
        copy_config(dtype, row) for dtype in DTYPES for row in (64, 256, 512, 4096)
    }

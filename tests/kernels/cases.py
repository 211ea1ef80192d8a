"""Random inputs and tolerances shared by the kernel tests.

Every case draws fresh random values from a generator seeded by the case
itself (never zeros, never shared between cases), so a failure reproduces
from its test id alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# (atol, rtol) per dtype: fp32 kernels must match the fp32 reference to 1e-5;
# half-precision ones round intermediates (P before P@V) and get 1e-2.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (1e-2, 1e-2),
}

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# Block table entries past a sequence's last block: never read by any backend.
UNUSED_BLOCK_ID = 1_000_000


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert not torch.isnan(actual).any(), "output has NaN: some element was never written"
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


@dataclass(frozen=True, slots=True)
class PagedCase:
    q: torch.Tensor  # [B, Hq, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32, rows strided (not contiguous)
    context_lens: torch.Tensor  # [B] int32
    scale: float


def make_paged_case(
    seed: int,
    context_lens: list[int],
    *,
    dtype: torch.dtype,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    spare_blocks: int = 3,
) -> PagedCase:
    """Sequences of the given lengths over shuffled blocks of one random cache.

    Blocks are handed out from a random permutation, so a sequence's blocks
    are neither ordered nor adjacent; the table has one unused column filled
    with an out-of-range id, and is a strided view of a wider tensor.
    """
    gen = generator(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = max(blocks_per_seq + [1]) + 1
    storage = torch.full((len(context_lens), width + 2), UNUSED_BLOCK_ID, dtype=torch.int32)
    used = 0
    for row, n in enumerate(blocks_per_seq):
        storage[row, :n] = perm[used : used + n]
        used += n
    kv_cache = randn((2, num_blocks, block_size, num_kv_heads, head_dim), dtype, gen)
    q = randn((len(context_lens), num_kv_heads * group, head_dim), dtype, gen)
    return PagedCase(
        q=q,
        kv_cache=kv_cache,
        block_tables=storage[:, :width],
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        scale=1.0 / math.sqrt(head_dim),
    )


def rope_cache(max_position: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """[max_position, head_dim] float32: cos of each angle in the first half, sin in the second."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=1).to(torch.float32)


def rope_angles(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return positions.to(torch.float64)[:, None] * inv_freq[None, :]

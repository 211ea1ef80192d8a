"""Chained block hashes of token ids: the one definition the engine's prefix
cache (engine/prefix_cache.py), the pods' cache events (pod/cache_events.py)
and the router's prefix index (router/cache_index/) share.

A full block's hash is xxhash64 over its parent block's hash (8 bytes,
little endian; a fixed root marker for the first block) and its token ids
(each 8 bytes, little endian, signed), so a hash names the whole prefix up to
and including that block: equal hashes mean equal prefixes. Only full blocks
have hashes. The block size is the pod's own (`LoadReport.block_size`): the
same tokens hash differently under different block sizes.

Plain Python + xxhash, no project imports (proto/ is shared by pods and router).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

_ROOT_PARENT = b"pdserve-prefix-root\x00"


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """xxhash64 of (parent block hash, this block's token ids)."""
    h = xxhash.xxh64()
    h.update(_ROOT_PARENT if parent_hash is None else struct.pack("<Q", parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.intdigest()


def extend_block_hashes(block_hashes: list[int], token_ids: Sequence[int], block_size: int,
                        max_blocks: int | None = None) -> None:
    """Append the hashes of full blocks of `token_ids` not yet in `block_hashes`
    (at most `max_blocks` hashes in all, when given).

    Token lists are append-only, so hashes already computed stay valid.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 token, got {block_size}")
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    first = len(block_hashes)
    if first >= num_full:
        return
    # One pack for every new block, then one digest per block over (parent, block):
    # the same bytes `hash_block_tokens` hashes, at a fraction of the cost.
    data = memoryview(struct.pack(f"<{(num_full - first) * block_size}q",
                                  *token_ids[first * block_size : num_full * block_size]))
    width = 8 * block_size
    parent = block_hashes[first - 1] if first else None
    for i in range(num_full - first):
        head = _ROOT_PARENT if parent is None else struct.pack("<Q", parent)
        parent = xxhash.xxh64_intdigest(head + data[i * width : (i + 1) * width])
        block_hashes.append(parent)


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a `num_tokens` context a pod can take
    from its prefix cache: every full block but the one holding the last
    token, which is always computed (its logits are sampled). Mirrors
    `BlockManager.match_prefix`."""
    return max(0, num_tokens - 1) // block_size

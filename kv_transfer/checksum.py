"""Payload checksums, the same on both connectors' wires.

Every frame carries a checksum of its payload: XXH64 (seed 0), or for a DATA
frame whose flags have `FLAG_XXH3` set, XXH3-64 (about 3x cheaper than XXH64;
a sender option, `SenderConfig.checksum="xxh3"`; receivers verify whichever the
flag says, so the two interoperate). Control frames always carry XXH64. The
TCP header's flags byte and gRPC's `KVFrame.flags` use the same bit.
"""

from __future__ import annotations

import xxhash

# DATA only: the checksum is XXH3-64 (bit 1 of the frame's flags)
FLAG_XXH3 = 2
CHECKSUMS = ("xxh64", "xxh3")  # SenderConfig.checksum's choices


def checksum(payload: bytes | memoryview) -> int:
    """xxhash64, seed 0 (releases the GIL on large buffers)."""
    return xxhash.xxh64_intdigest(payload)


def data_checksum(payload: bytes | memoryview, flags: int) -> int:
    """The checksum a DATA frame with `flags` carries."""
    if flags & FLAG_XXH3:
        return xxhash.xxh3_64_intdigest(payload)
    return xxhash.xxh64_intdigest(payload)


def checksum_name(flags: int) -> str:
    """The algorithm a DATA frame with `flags` names ("xxh3" or "xxh64")."""
    return "xxh3" if flags & FLAG_XXH3 else "xxh64"

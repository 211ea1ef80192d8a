"""KV inject (scatter into paged blocks) and extract (gather out of them) in Triton.

Both move whole token rows (`num_kv_heads * head_dim` elements) of K and V
between the paged cache `[2, num_blocks, block_size, Hkv, D]` and the
block-size independent transfer layout `[2, T, Hkv, D]`. A token's row in
the cache starts at `slot * row` in each of the K and V planes, because the
cache is contiguous and `slot = block_id * block_size + offset`; so one
launch covers any number of requests through the flat slot mapping, and a
request's partial last block needs no special case.

The copy is bit-exact: rows are moved as 16- or 32-bit integers, so one
compiled variant serves fp16 and bf16 alike. One program copies one chunk
of one token's K row and the same chunk of its V row.

Called by `kernels.dispatch.inject_kv` / `extract_kv` (the decode pod's KV
injector thread and the prefill pod's KV sender) after `kernels.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
CHUNKS = (256, 1024)


@dataclass(frozen=True, slots=True)
class CopyConfig:
    """Compile-time choices of the copy kernels."""

    bits: int  # element width moved: 16 or 32
    chunk: int  # elements of a row per program

    def __post_init__(self) -> None:
        if self.bits not in (16, 32) or self.chunk not in CHUNKS:
            raise ValueError(f"copy config bits={self.bits} chunk={self.chunk} unsupported")


def copy_config(dtype: torch.dtype, row: int) -> CopyConfig:
    """The one place a copy variant is chosen (launchers and AOT test share it)."""
    bits = 32 if _BITS[dtype] == torch.int32 else 16
    return CopyConfig(bits, 256 if row <= 256 else 1024)


def all_copy_configs() -> list[CopyConfig]:
    return [CopyConfig(bits, chunk) for bits in (16, 32) for chunk in CHUNKS]


@triton.jit
def _inject_kernel(
    k_cache_ptr, v_cache_ptr, src_ptr, slot_mapping_ptr, num_slots, row,
    stride_src_kv, stride_src_t,
    CHUNK: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    slot = tl.load(slot_mapping_ptr + token)
    # Negative slots are padding; out-of-range ones are a caller bug that
    # must not become an out-of-bounds write. (The scalar test folds into
    # the column bound: Triton's interpreter rejects scalar & vector masks.)
    keep = cols < row * ((slot >= 0) & (slot < num_slots)).to(tl.int32)
    src = src_ptr + token.to(tl.int64) * stride_src_t + cols
    dst = slot * row + cols
    tl.store(k_cache_ptr + dst, tl.load(src, mask=keep), mask=keep)
    tl.store(v_cache_ptr + dst, tl.load(src + stride_src_kv, mask=keep), mask=keep)


@triton.jit
def _extract_kernel(
    k_cache_ptr, v_cache_ptr, out_k_ptr, out_v_ptr, slot_mapping_ptr, num_slots, row,
    CHUNK: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    in_row = cols < row
    slot = tl.load(slot_mapping_ptr + token)
    keep = cols < row * ((slot >= 0) & (slot < num_slots)).to(tl.int32)
    src = slot * row + cols
    dst = token.to(tl.int64) * row + cols
    # Rows of skipped slots are written as zeros so `out` is always fully defined.
    tl.store(out_k_ptr + dst, tl.load(k_cache_ptr + src, mask=keep, other=0), mask=in_row)
    tl.store(out_v_ptr + dst, tl.load(v_cache_ptr + src, mask=keep, other=0), mask=in_row)


def _planes(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    bits = kv_cache.view(_BITS[kv_cache.dtype])
    return bits[0], bits[1], num_blocks * block_size, num_kv_heads * head_dim


def inject_kv_triton(kv_cache: torch.Tensor, src: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Launcher; inputs validated by dispatch. src may be a token range of a larger buffer."""
    if src.stride(3) != 1 or src.stride(2) != src.shape[3]:
        src = src.contiguous()  # the kernel reads each token's [Hkv, D] row as one run
    k_plane, v_plane, num_slots, row = _planes(kv_cache)
    config = copy_config(kv_cache.dtype, row)
    num_tokens = src.shape[1]
    _inject_kernel[(num_tokens, triton.cdiv(row, config.chunk))](
        k_plane, v_plane, src.view(_BITS[src.dtype]), slot_mapping, num_slots, row,
        src.stride(0), src.stride(1),
        CHUNK=config.chunk, num_warps=4,
    )


def extract_kv_triton(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Launcher; `out` (if given) is a contiguous [2, T, Hkv, D] tensor on the cache's device."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = slot_mapping.shape[0]
    if out is None:
        out = torch.empty((2, num_tokens, num_kv_heads, head_dim), dtype=kv_cache.dtype,
                          device=kv_cache.device)
    k_plane, v_plane, num_slots, row = _planes(kv_cache)
    config = copy_config(kv_cache.dtype, row)
    out_bits = out.view(_BITS[out.dtype])
    _extract_kernel[(num_tokens, triton.cdiv(row, config.chunk))](
        k_plane, v_plane, out_bits[0], out_bits[1], slot_mapping, num_slots, row,
        CHUNK=config.chunk, num_warps=4,
    )
    return out

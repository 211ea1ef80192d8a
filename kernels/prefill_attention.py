"""Paged prefill attention in Triton: new tokens attend to cached prefix + themselves.

Batch layout (varlen): q [T, Hq, D] holds the new tokens of S sequences
back to back; sequence s owns rows [query_start_loc[s], query_start_loc[s+1])
and its new tokens are the last `qlen` of its `context_lens[s]` positions.
Their K/V must already be in the cache (the engine injects a layer's K/V
before attending), so one walk over the paged cache through the block table
covers both the cached prefix and the causal part.

Work split: one program per (query tile, KV head). A query tile is BLOCK_M
consecutive new tokens of one sequence times all query heads of the KV
head, flattened into `rows` rows (BLOCK_M = rows / group_pad; 64 rows, fewer
at head dim 256), so GQA heads share every K/V load; a padded group wider
than `rows` is cut into `head_slices` programs of `rows` heads each. The
program walks key tiles of `tile_n` tokens from the window start of its
first token to its last token, with a causal (and sliding-window) mask per
row and an online softmax in base 2. The tile list is built on the host
from query_start_loc (one small device-to-host copy). The head-dim axis is
padded to a power of two as in the decode kernel (96 in a 128 tile, every
load and store masked on it; `head_dim_mask`).

Called by `kernels.dispatch.paged_prefill_attention` after
`kernels.checks.check_prefill_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import BLOCK_SIZES, HEAD_DIMS, MAX_GQA_GROUP
from kernels.paged_attention import (
    LOG2E,
    dot_in_fp32,
    head_dim_mask,
    padded_head_dim,
    soft_cap_log2,
)

ROWS = 64  # query rows (tokens x heads) per program (fewer at head_dim 256: prefill_config)
NO_WINDOW = 1 << 30  # the window passed when there is none: longer than any context
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True, slots=True)
class PrefillAttentionConfig:
    """Compile-time choices of the prefill kernel (one compiled variant each)."""

    dtype: str
    head_dim: int
    block_size: int
    group_pad: int  # query heads per program: the group padded to a power of two, <= rows
    tile_n: int
    num_warps: int
    rows: int = ROWS  # query rows (tokens x heads) per program
    head_slices: int = 1  # programs per KV head (group_pad * head_slices heads)

    def __post_init__(self) -> None:
        if self.head_dim not in HEAD_DIMS or self.block_size not in BLOCK_SIZES:
            raise ValueError(f"head_dim {self.head_dim} / block_size {self.block_size} unsupported")
        if self.group_pad & (self.group_pad - 1) or not 1 <= self.group_pad <= MAX_GQA_GROUP:
            raise ValueError(f"group_pad {self.group_pad} must be a power of two <= 64")
        if self.rows not in (16, 32, 64) or self.group_pad > self.rows:
            raise ValueError(f"rows {self.rows} must be 16, 32 or 64 and >= group_pad "
                             f"{self.group_pad}")
        if self.head_slices & (self.head_slices - 1) or (
                self.group_pad * self.head_slices > MAX_GQA_GROUP):
            raise ValueError(f"head_slices {self.head_slices} of {self.group_pad} heads "
                             "unsupported")

    @property
    def block_m(self) -> int:
        return self.rows // self.group_pad

    @property
    def block_d(self) -> int:
        return padded_head_dim(self.head_dim)


def prefill_config(dtype: torch.dtype, head_dim: int, block_size: int, group: int
                   ) -> PrefillAttentionConfig:
    """The one place a prefill variant is chosen (launcher and AOT test share it)."""
    if not 1 <= group <= MAX_GQA_GROUP:
        raise ValueError(f"GQA group {group} outside 1..{MAX_GQA_GROUP}")
    group_pad = 1 << (group - 1).bit_length()
    block_d = padded_head_dim(head_dim)  # 96 runs in 128-wide tiles: same choices
    # Chosen from ptxas's allocation (docs/kernels.md). Up to head_dim 128
    # every program holds 64 query rows: 64-token tiles with 8 warps for
    # fp16/bf16; exact fp32 dots run on FMA units with larger register
    # tiles: 16-token tiles, and 16 warps at head_dim 128 (8 spill there; 16
    # spill at head_dim 64). At head_dim 256 no 64-row program is free of
    # spills: 32 rows with 32-token key tiles and 8 warps in half precision
    # (16-token ones for a group of 1, whose 32 query tokens per program
    # spill with 32), 16 rows with 16-token tiles in fp32, 4 warps for
    # groups of 2-8 and 8 otherwise (on sm_80, 8 warps spill for groups of
    # 2-8 and 4 for a sliced group); wider groups are sliced.
    rows = ROWS
    if block_d == 256:
        if dtype == torch.float32:
            rows, tile_n, num_warps = 16, 16, (4 if 2 <= group_pad <= 8 else 8)
        else:
            rows, tile_n, num_warps = 32, (16 if group_pad == 1 else 32), 8
    elif dtype == torch.float32:
        tile_n, num_warps = 16, (16 if block_d == 128 else 8)
    else:
        tile_n, num_warps = 64, 8
    head_slices = max(1, group_pad // rows)
    return PrefillAttentionConfig(_DTYPE_NAMES[dtype], head_dim, block_size,
                                  group_pad // head_slices, tile_n, num_warps, rows, head_slices)


def all_prefill_configs() -> list[PrefillAttentionConfig]:
    return [
        prefill_config(dtype, head_dim, block_size, group)
        for dtype in _DTYPE_NAMES
        for head_dim in HEAD_DIMS
        for block_size in BLOCK_SIZES
        for group in (1, 2, 3, 5, 9, 17, 33)  # one group per padded group
    ]


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
    tile_seq_ptr, tile_start_ptr, scale_log2, sliding_window, softcap_log2, group,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr, HEAD_SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_SLICES
    first_head = (tl.program_id(1) % HEAD_SLICES) * GROUP_PAD  # 0 unless the group is sliced
    seq = tl.load(tile_seq_ptr + tile)
    m_start = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_ptr + seq)
    qlen = tl.load(query_start_ptr + seq + 1) - q_begin
    first_pos = tl.load(context_lens_ptr + seq) - qlen

    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = head_dim_mask(dims, HEAD_DIM, BLOCK_D)  # padding lanes: loaded as 0, not stored
    tok = m_start + rows // GROUP_PAD
    head = kv_head * group + rows % GROUP_PAD + first_head
    row_ok = (tok < qlen) & (rows % GROUP_PAD + first_head < group)
    pos_q = first_pos + tok
    # Lowest visible key per row (no window = a window longer than any context).
    row_lo = tl.maximum(pos_q + 1 - sliding_window, 0)
    q_off = (q_begin + tok).to(tl.int64)
    q = tl.load(q_ptr + q_off[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    hi = tl.minimum(first_pos + m_start + BLOCK_M, first_pos + qlen)
    lo = tl.maximum(first_pos + m_start + 1 - sliding_window, 0)
    m = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo - lo % TILE_N, hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        kv_ok = (pos >= lo) & (pos < hi)
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        token = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        k_t = tl.load(k_ptr + token[None, :] + dims[:, None],
                      mask=dim_ok[:, None] & kv_ok[None, :], other=0.0)
        if DOT_FP32:
            scores = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k_t)
        visible = (kv_ok[None, :] & (pos[None, :] <= pos_q[:, None])
                   & (pos[None, :] >= row_lo[:, None]))
        scores = scores * scale_log2
        if SOFTCAP:
            scores = soft_cap_log2(scores, softcap_log2)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # A row may see no key of this tile yet (causal mask): keep it at zero weight.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(scores - m_use[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + token[:, None] + dims[None, :],
                    mask=kv_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + q_off[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _tiles(query_start_loc: torch.Tensor, block_m: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    starts = query_start_loc.tolist()
    seqs, firsts = [], []
    for seq, (begin, end) in enumerate(zip(starts, starts[1:], strict=False)):
        for first in range(0, end - begin, block_m):
            seqs.append(seq)
            firsts.append(first)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    return as_tensor(seqs), as_tensor(firsts)


def paged_prefill_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher; inputs validated by `kernels.checks.check_prefill_attention`."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    config = prefill_config(q.dtype, head_dim, block_size, group)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} "
                         f"{q.dtype} with a contiguous last dimension")
    tile_seq, tile_start = _tiles(query_start_loc.cpu(), config.block_m, q.device)
    if tile_seq.numel() == 0:
        return out
    key, value = kv_cache[0], kv_cache[1]
    _prefill_kernel[(tile_seq.numel(), num_kv_heads * config.head_slices)](
        q, key, value, out, block_tables, query_start_loc, context_lens, tile_seq, tile_start,
        scale * LOG2E, sliding_window or NO_WINDOW, (softcap or 1.0) * LOG2E, group,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), key.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=config.block_d, BLOCK_SIZE=block_size,
        GROUP_PAD=config.group_pad, HEAD_SLICES=config.head_slices, BLOCK_M=config.block_m,
        TILE_N=config.tile_n, DOT_FP32=dot_in_fp32(q.dtype), SOFTCAP=softcap is not None,
        num_warps=config.num_warps,
    )
    return out

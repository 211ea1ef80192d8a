"""Paged decode attention in Triton: split-KV (flash-decoding) with a reduce pass.

Work split: one program per (sequence, KV head, split). A split is a range of
`partition_size` context positions; the program walks it in tiles of
`tile_n` tokens, loading for each token its block id from the block table
(so a tile may span several small blocks, or sit inside one large block), and
keeps an online softmax for *all* query heads of its KV head at once (GQA:
the group is padded to a tile of >= 16 rows so both products are `tl.dot`s;
where that tile would not fit one program, `head_slices` programs share the
KV head, each taking a slice of the group). It writes the split's normalised
output and its log-sum-exp (base 2); the reduce kernel then merges the
splits of each (sequence, query head).

Head dims: the head-dim axis is a tile of BLOCK_D = the head dim rounded up
to a power of two (Triton's tiles are powers of two). 96 runs in 128 with
every load and store masked on that axis (`head_dim_mask`): padding lanes
load zeros, add nothing to q.k, and are never written. For 64, 128 and 256
the mask is a constant and folds away (their compiled code is unchanged).

Called by `kernels.dispatch.paged_decode_attention` after `kernels.checks`;
`tests/kernels/test_aot.py` compiles every configuration
`decode_config` can return (`all_decode_configs`) for sm_80 and sm_90.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import BLOCK_SIZES, HEAD_DIMS, MAX_GQA_GROUP

# The reduce kernel merges at most this many splits in one tile.
MAX_SPLITS = 32
# Enough (sequence, KV head, split) programs to fill an H100/H200 several
# times over; more splits only add reduce work.
TARGET_PROGRAMS = 512
# A split never covers fewer positions than this: shorter ones cost more in
# partial writes than they gain in parallelism.
MIN_PARTITION = 256
GROUP_PADS = (16, 32, 64)
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True, slots=True)
class DecodeAttentionConfig:
    """Compile-time choices of the partial kernel (one compiled variant each)."""

    dtype: str  # "fp32" | "fp16" | "bf16"
    head_dim: int
    block_size: int
    group_pad: int  # query heads per program, a power of two >= 16
    tile_n: int  # tokens per inner iteration
    num_warps: int
    # Programs per KV head, each taking group_pad of its query heads: 1 but
    # where a whole padded group does not fit one program (fp32 at head_dim
    # 256, group > 32: q alone would take 64 KiB of shared memory).
    head_slices: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_NAMES.values():
            raise ValueError(f"dtype {self.dtype!r} not one of {tuple(_DTYPE_NAMES.values())}")
        if self.head_dim not in HEAD_DIMS or self.block_size not in BLOCK_SIZES:
            raise ValueError(f"head_dim {self.head_dim} / block_size {self.block_size} unsupported")
        if self.group_pad not in GROUP_PADS:
            raise ValueError(f"group_pad {self.group_pad} not one of {GROUP_PADS}")
        if self.head_slices not in (1, 2) or self.group_pad * self.head_slices > MAX_GQA_GROUP:
            raise ValueError(f"head_slices {self.head_slices} of {self.group_pad} heads "
                             "unsupported")

    @property
    def block_d(self) -> int:
        return padded_head_dim(self.head_dim)


def padded_head_dim(head_dim: int) -> int:
    """The head-dim tile (constexpr BLOCK_D): head_dim rounded up to a power of two."""
    return 1 << (head_dim - 1).bit_length()


def decode_config(dtype: torch.dtype, head_dim: int, block_size: int,
                  group: int) -> DecodeAttentionConfig:
    """The one place a decode variant is chosen (launcher and AOT test share it)."""
    if not 1 <= group <= MAX_GQA_GROUP:
        raise ValueError(f"GQA group {group} outside 1..{MAX_GQA_GROUP}")
    group_pad = max(16, 1 << (group - 1).bit_length())
    block_d = padded_head_dim(head_dim)  # 96 runs in 128-wide tiles: same choices
    # Chosen from ptxas's allocation on sm_80 and sm_90 (docs/kernels.md):
    # the largest token tile whose K, V, scores and accumulator stay in
    # registers without spilling. 8 warps: with 4, the 64-token
    # half-precision tiles spill at head_dim 128. Exact fp32 dots run on
    # FMA units with larger register tiles, hence the smaller token tiles
    # and, for the widest group at head_dim 128, 16 warps. At head_dim 256
    # every tile is twice as wide: 32 tokens (16 for the 64-row group) in
    # half precision, 16 in fp32, whose 64-row group also overflows shared
    # memory (q alone is 64 KiB) and runs as two programs of 32 heads.
    tile_n, num_warps, head_slices = 64, 8, 1
    if block_d == 256:
        if dtype == torch.float32:
            tile_n = 16
            if group_pad == 64:
                group_pad, head_slices = 32, 2
        else:
            tile_n = 16 if group_pad == 64 else 32
    elif dtype == torch.float32 and (block_d == 128 or group_pad == 64):
        tile_n = 32
        num_warps = 16 if block_d == 128 and group_pad == 64 else 8
    return DecodeAttentionConfig(_DTYPE_NAMES[dtype], head_dim, block_size, group_pad, tile_n,
                                 num_warps, head_slices)


def all_decode_configs() -> list[DecodeAttentionConfig]:
    """Every configuration `decode_config` can return."""
    groups = (1, 17, 33)  # one group per group_pad
    return [
        decode_config(dtype, head_dim, block_size, group)
        for dtype in _DTYPE_NAMES
        for head_dim in HEAD_DIMS
        for block_size in BLOCK_SIZES
        for group in groups
    ]


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether both products run as exact fp32 dots (constexpr DOT_FP32).

    fp32 inputs always do (the default tf32 would miss the 1e-5 tolerance).
    bf16 does too under Triton's CPU interpreter only, whose `tl.dot` on bf16
    multiplies the raw bit patterns (triton 3.9); compiled kernels use the
    native bf16 tensor-core dot.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and triton.knobs.runtime.interpret)


def split_plan(batch: int, num_kv_heads: int, max_positions: int, tile_n: int) -> tuple[int, int]:
    """(num_splits, partition_size) for a batch whose contexts are at most max_positions.

    Runtime values, not constexprs: the split count never adds a compiled variant.
    """
    wanted = max(1, math.ceil(TARGET_PROGRAMS / max(1, batch * num_kv_heads)))
    by_length = max(1, math.ceil(max_positions / MIN_PARTITION))
    return _partition(max_positions, min(wanted, by_length, MAX_SPLITS), tile_n)


def _partition(max_positions: int, num_splits: int, tile_n: int) -> tuple[int, int]:
    per_split = math.ceil(max_positions / num_splits)
    partition = max(tile_n, math.ceil(per_split / tile_n) * tile_n)
    return math.ceil(max_positions / partition), partition


LOG2E = 1.4426950408889634


@triton.jit
def soft_cap_log2(scores, softcap_log2):
    """softcap * tanh(s / softcap) for scores already in base-2 units
    (s * log2 e), with softcap_log2 = softcap * log2 e: the cap commutes with
    the change of base. tanh(y) = 1 - 2 / (2^(2y log2 e) + 1), exact at the
    limits (+-1) and within a few float32 ulp of 1 elsewhere; Triton has no
    tanh of its own that also runs under the interpreter."""
    y = scores / softcap_log2
    return softcap_log2 * (1.0 - 2.0 / (tl.exp2(y * (2.0 * 1.4426950408889634)) + 1.0))


@triton.jit
def head_dim_mask(dims, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """`dims < HEAD_DIM` for a head-dim tile `dims = arange(0, BLOCK_D)`. A
    constant true when the head fills its tile, so `mask & head_dim_mask(...)`
    folds back to `mask` and the unpadded variants compile to the code they
    had before padding existed."""
    if HEAD_DIM == BLOCK_D:
        ok = tl.full([BLOCK_D], 1, tl.int1)
    else:
        ok = dims < HEAD_DIM
    return ok


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, sliding_window, softcap_log2, partition_size, group,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
    stride_pb, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr, HEAD_SLICES: tl.constexpr, TILE_N: tl.constexpr,
    DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_SLICES
    first_row = (tl.program_id(1) % HEAD_SLICES) * GROUP_PAD  # 0 unless the group is sliced
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    window_start = tl.where(sliding_window > 0, tl.maximum(context_len - sliding_window, 0), 0)
    lo = tl.maximum(split * partition_size, window_start)
    hi = tl.minimum(split * partition_size + partition_size, context_len)
    first = lo - lo % TILE_N
    # An empty split runs no iteration (every visited tile then has >= 1 valid
    # token, so the running max is finite after the first one).
    end = tl.where(lo < hi, hi, first)

    rows = first_row + tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    # Padding lanes of the head dim (96 in a 128 tile) load as 0, so they add
    # nothing to q.k and their output columns (0) are never stored.
    dim_ok = head_dim_mask(dims, HEAD_DIM, BLOCK_D)
    row_ok = rows < group
    q_heads = kv_head * group + rows
    q = tl.load(q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(first, end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        valid = (pos >= lo) & (pos < hi)
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        token = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        k_t = tl.load(k_ptr + token[None, :] + dims[:, None],
                      mask=dim_ok[:, None] & valid[None, :], other=0.0)
        if DOT_FP32:
            scores = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k_t)
        scores = scores * scale_log2
        if SOFTCAP:
            scores = soft_cap_log2(scores, softcap_log2)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + token[:, None] + dims[None, :],
                    mask=valid[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    nonempty = l_sum > 0
    out = acc / tl.where(nonempty, l_sum, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l_sum, 1.0)), float("-inf"))
    base = seq * stride_pb + q_heads * stride_ph + split * stride_ps
    tl.store(part_out_ptr + base[:, None] * HEAD_DIM + dims[None, :], out,
             mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(part_lse_ptr + base, lse, mask=row_ok)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = head_dim_mask(dims, HEAD_DIM, BLOCK_D)
    base = seq * stride_pb + head * stride_ph + splits
    lse = tl.load(part_lse_ptr + base, mask=splits < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    # Empty splits (and padding) carry -inf; a row with no split at all
    # (context_len 0) has top = -inf and gets zeros instead of NaN.
    top = tl.where(top > float("-inf"), top, 0.0)
    weight = tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0)
    parts = tl.load(part_out_ptr + base[:, None] * HEAD_DIM + dims[None, :],
                    mask=(weight > 0)[:, None] & dim_ok[None, :], other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_decode_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher; inputs already validated by `kernels.checks.check_decode_attention`.

    `num_splits` overrides the split plan (tests use it to force several
    splits on short contexts); it is capped at MAX_SPLITS. `out` is an
    optional preallocated [B, Hq, D] result in q's dtype (contiguous last dim).
    """
    batch, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    config = decode_config(q.dtype, head_dim, block_size, group)
    # The table's width bounds every context without reading context_lens on
    # the host (no device sync); programs past a sequence's end exit at once.
    max_positions = block_tables.shape[1] * block_size
    if num_splits is None:
        splits, partition = split_plan(batch, num_kv_heads, max_positions, config.tile_n)
    else:
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits {num_splits} outside 1..{MAX_SPLITS}")
        splits, partition = _partition(max_positions, num_splits, config.tile_n)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} "
                         f"{q.dtype} with a contiguous last dimension")
    if batch == 0:
        return out
    part_out = torch.empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty((batch, num_q_heads, splits), dtype=torch.float32, device=q.device)
    key, value = kv_cache[0], kv_cache[1]
    _decode_partial_kernel[(batch, num_kv_heads * config.head_slices, splits)](
        q, key, value, block_tables, context_lens, part_out, part_lse,
        scale * LOG2E, sliding_window or 0, (softcap or 1.0) * LOG2E, partition, group,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2),
        block_tables.stride(0),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=config.block_d, BLOCK_SIZE=block_size,
        GROUP_PAD=config.group_pad, HEAD_SLICES=config.head_slices, TILE_N=config.tile_n,
        DOT_FP32=dot_in_fp32(q.dtype), SOFTCAP=softcap is not None,
        num_warps=config.num_warps,
    )
    _decode_reduce_kernel[(batch, num_q_heads)](
        part_out, part_lse, out, splits,
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=config.block_d, SPLITS_PAD=MAX_SPLITS, num_warps=4,
    )
    return out

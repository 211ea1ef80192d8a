"""Shape and dtype checks shared by every backend of every kernel.

`kernels.dispatch` calls these before choosing a backend, so the torch
reference and the Triton launchers refuse exactly the same inputs with the
same messages. Each check raises ValueError naming the argument, what it
was, and what is allowed. None of them synchronises with the device: values
inside tensors (slot ids, context lengths) are the caller's contract and are
documented on the public functions instead.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
# Head dims the Triton kernels are compiled for; the reference and the native
# kernels accept the same set so every backend serves the same models. 96
# (Phi-3-mini/3.5-mini) runs in 128-wide tiles with the head-dim axis masked;
# 256 (Gemma 2 2B/9B, Gemma 3 1B) in its own tiles.
HEAD_DIMS: tuple[int, ...] = (64, 96, 128, 256)
BLOCK_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)
# Query heads per KV head the decode kernel pads to a tile of at most 64 rows.
MAX_GQA_GROUP = 64
# RMSNorm keeps a whole row in registers (Llama 3.1 405B: 16384).
MAX_HIDDEN = 16384


def check_float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {FLOAT_DTYPES}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    # Called on every kernel call: no dict or set unless it fails.
    devices = [t.device for t in tensors.values()]
    if devices.count(devices[0]) != len(devices):
        found = {name: t.device for name, t in tensors.items()}
        raise ValueError(f"tensors must be on one device, got {found}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # The kernels address the innermost dimension with stride 1 so loads
    # vectorise; every other stride is passed explicitly.
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def check_kv_cache(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validates one layer's cache [2, num_blocks, block_size, Hkv, D]; returns its sizes."""
    check_ndim("kv_cache", kv_cache, 5, "[2, num_blocks, block_size, num_kv_heads, head_dim]")
    check_float_dtype("kv_cache", kv_cache)
    if kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache dim 0 must be 2 (K, V), got {kv_cache.shape[0]}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (one preallocated tensor per layer)")
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"kv_cache block_size {block_size} not supported; expected {BLOCK_SIZES}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"kv_cache head_dim {head_dim} not supported; expected {HEAD_DIMS}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    check_ndim("q", q, 3, "[batch, num_q_heads, head_dim]")
    check_float_dtype("q", q)
    check_last_dim_contiguous("q", q)
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    batch, num_q_heads, q_head_dim = q.shape
    if q_head_dim != head_dim:
        raise ValueError(f"q head_dim {q_head_dim} differs from kv_cache head_dim {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    if num_q_heads // num_kv_heads > MAX_GQA_GROUP:
        raise ValueError(
            f"GQA group {num_q_heads // num_kv_heads} exceeds the supported {MAX_GQA_GROUP}"
        )
    check_ndim("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    check_last_dim_contiguous("block_tables", block_tables)
    check_ndim("context_lens", context_lens, 1, "[batch]")
    if context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32, got {context_lens.dtype}")
    if block_tables.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(
            f"batch mismatch: q {batch}, block_tables {block_tables.shape[0]}, "
            f"context_lens {context_lens.shape[0]}"
        )
    if block_tables.shape[1] < 1:
        raise ValueError("block_tables needs at least one column")
    check_same_device(q=q, kv_cache=kv_cache, block_tables=block_tables, context_lens=context_lens)
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    check_softcap(softcap)


def check_softcap(softcap: float | None) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens"
        )


def check_transfer_rows(name: str, rows: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """Validates a [2, T, Hkv, D] transfer tensor against the cache; returns T."""
    _, _, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    check_ndim(name, rows, 4, "[2, num_tokens, num_kv_heads, head_dim]")
    if rows.dtype != kv_cache.dtype:
        raise ValueError(f"{name} dtype {rows.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    if rows.shape[0] != 2 or tuple(rows.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"{name} shape {tuple(rows.shape)} does not match "
            f"[2, num_tokens, {num_kv_heads}, {head_dim}]"
        )
    if rows.device != kv_cache.device:
        raise ValueError(f"{name} is on {rows.device} but kv_cache on {kv_cache.device}")
    return rows.shape[1]


def check_output(name: str, t: torch.Tensor | None, like: torch.Tensor) -> None:
    """A preallocated output (`like` itself: in place) must be contiguous with
    `like`'s shape, dtype and device."""
    if t is None:
        return
    if t is not like and (t.shape != like.shape or t.dtype != like.dtype
                          or t.device != like.device):
        raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} on {t.device} must match "
                         f"{tuple(like.shape)} {like.dtype} on {like.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
    out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
) -> None:
    check_ndim("x", x, 2, "[num_tokens, hidden]")
    check_float_dtype("x", x)
    check_float_dtype("weight", weight)
    check_last_dim_contiguous("x", x)
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[1]} exceeds the supported {MAX_HIDDEN}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} must be ({x.shape[1]},)")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match "
                f"x {tuple(x.shape)} {x.dtype}"
            )
        check_last_dim_contiguous("residual", residual)
        check_same_device(x=x, weight=weight, residual=residual)
    else:
        check_same_device(x=x, weight=weight)
        if residual_out is not None:
            raise ValueError("residual_out given without a residual")
    check_output("out", out, x)
    check_output("residual_out", residual_out, x)


def check_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    check_ndim("positions", positions, 1, "[num_tokens]")
    if positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64, got {positions.dtype}")
    check_ndim("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    check_ndim("k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_float_dtype("q", q)
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} differs from q dtype {q.dtype}")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("k", k)
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or positions.shape[0] != num_tokens:
        raise ValueError(
            f"token count mismatch: positions {positions.shape[0]}, q {num_tokens}, k {k.shape[0]}"
        )
    if k.shape[2] != head_dim:
        raise ValueError(f"k head_dim {k.shape[2]} differs from q head_dim {head_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} not supported; expected {HEAD_DIMS}")
    check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, rotary_dim]")
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be float32, got {cos_sin_cache.dtype}")
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache rotary_dim {cos_sin_cache.shape[1]} must equal head_dim {head_dim}"
        )
    if not cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache must be contiguous")
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)


def check_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> None:
    """Like check_decode_attention, plus the varlen layout; reads the (small)
    query_start_loc and context_lens on the host, which prefill needs anyway."""
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    check_ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    if query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32, got {query_start_loc.dtype}")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries for {num_seqs} sequences"
        )
    check_ndim("q", q, 3, "[num_new_tokens, num_q_heads, head_dim]")
    check_last_dim_contiguous("q", q)
    # Reuse the decode checks with a stand-in of one query row per sequence
    # (same dtype, heads, device): same cache, table and GQA rules.
    check_decode_attention(q.new_empty((max(num_seqs, 0), q.shape[1], q.shape[2])),
                           kv_cache, block_tables, context_lens, scale, sliding_window, softcap)
    check_same_device(q=q, query_start_loc=query_start_loc)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    if starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"query_start_loc must run from 0 to {q.shape[0]}, got {starts}")
    for seq, (begin, end) in enumerate(zip(starts, starts[1:], strict=False)):
        if not 0 <= end - begin <= lens[seq]:
            raise ValueError(
                f"sequence {seq}: {end - begin} new tokens for context_len {lens[seq]}"
            )
        if lens[seq] > block_tables.shape[1] * kv_cache.shape[2]:
            raise ValueError(f"sequence {seq}: context_len {lens[seq]} exceeds its block table")


def check_silu_and_mul(x: torch.Tensor) -> None:
    check_ndim("x", x, 2, "[num_tokens, 2 * intermediate]")
    check_float_dtype("x", x)
    check_last_dim_contiguous("x", x)
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x width {x.shape[1]} must be even: [gate | up] halves")


def check_decode_qkv_attention(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, sliding_window: int | None,
    softcap: float | None = None,
) -> int:
    """Validates the fused decode attention's arguments; returns num_q_heads."""
    _, _, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    check_ndim("qkv", qkv, 2, "[batch, (num_q_heads + 2 * num_kv_heads) * head_dim]")
    batch, width = qkv.shape
    num_q_heads = width // head_dim - 2 * num_kv_heads
    if width % head_dim != 0 or num_q_heads < 1:
        raise ValueError(f"qkv width {width} is not (num_q_heads + 2 * {num_kv_heads}) * "
                         f"{head_dim} for the cache's {num_kv_heads} kv heads of {head_dim}")
    q = qkv[:, : num_q_heads * head_dim].unflatten(1, (num_q_heads, head_dim))
    check_decode_attention(q, kv_cache, block_tables, context_lens, scale, sliding_window,
                           softcap)
    # k is q's sibling in the same rows (same dtype, strides, head_dim): a
    # slice of q stands in for it.
    check_rotary(positions, q, q[:, :num_kv_heads], cos_sin_cache)
    check_slot_mapping(slot_mapping, batch)
    check_same_device(qkv=qkv, slot_mapping=slot_mapping)
    return num_q_heads

"""Plain-torch references for every kernel; also the CPU backend of `kernels.dispatch`.

These functions define what the Triton kernels must compute, so they are
written for clarity first, but they are batched (no Python loop over
sequences or tokens) because the engine runs them on CPU pods. They import
nothing but torch: `kernels` must import on a machine without Triton.

Callers: `kernels.dispatch` (backend "torch", or "auto" off CUDA) after the
checks in `kernels.checks`; the kernel tests, which check these against
independent straightforward computations before comparing kernels to them.
"""

from __future__ import annotations

import torch


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence attends to its paged K/V (fp32 math).

    With `softcap` C, each scaled score s becomes C * tanh(s / C) before the
    mask and softmax (Gemma 2's attention logit soft-capping).
    Rows with context_len 0 (padding) return zeros. Block table entries past a
    sequence's last block are never read, so they may hold any value.
    """
    batch, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    max_len = min(int(context_lens.max().item()) if batch else 0,
                  block_tables.shape[1] * block_size)
    out = torch.zeros_like(q)
    if max_len == 0:
        return out
    positions = torch.arange(max_len, device=q.device)
    lens = context_lens.to(torch.int64)[:, None]
    valid = positions[None, :] < lens  # [B, L]
    if sliding_window is not None:
        valid &= positions[None, :] >= lens - sliding_window
    # Invalid positions may point at garbage table entries: send them to block 0.
    block_ids = block_tables.to(torch.int64)[:, positions // block_size]
    block_ids = torch.where(valid, block_ids, torch.zeros_like(block_ids))
    slots = block_ids * block_size + positions % block_size  # [B, L]
    flat = kv_cache.reshape(2, -1, num_kv_heads, head_dim)
    keys = flat[0][slots].float()  # [B, L, Hkv, D]
    values = flat[1][slots].float()
    qg = q.float().reshape(batch, num_kv_heads, group, head_dim)
    scores = soft_cap(torch.einsum("bhgd,blhd->bhgl", qg, keys) * scale, softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    has_any = valid.any(dim=1)
    # A padding row (no valid position) would softmax to NaN; give it zeros.
    scores = torch.where(has_any[:, None, None, None], scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1)
    attn = torch.einsum("bhgl,blhd->bhgd", probs, values)
    attn = attn * has_any[:, None, None, None]
    return attn.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """softcap * tanh(scores / softcap), or scores unchanged when softcap is None."""
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def inject_kv_reference(
    kv_cache: torch.Tensor, src: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_cache[:, slot // bs, slot % bs] = src[:, t] for every t; negative slots are skipped."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    flat[:, slot_mapping[keep]] = src[:, keep]


def extract_kv_reference(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gathers [2, T, Hkv, D] rows of the given slots; rows of negative slots are zeros."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = slot_mapping.shape[0]
    if out is None:
        out = torch.empty(
            (2, num_tokens, num_kv_heads, head_dim), dtype=kv_cache.dtype, device=kv_cache.device
        )
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    gathered = flat[:, slot_mapping.clamp(min=0)].to(out.device)
    out.copy_(torch.where(keep.to(out.device)[None, :, None, None], gathered,
                          torch.zeros_like(gathered)))
    return out


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = r / sqrt(mean(r^2) + eps) * weight in fp32, returned in x.dtype.

    With a residual, r = x + residual rounded to x.dtype first (that rounded r
    is what the next layer adds to), and (y, r) is returned; otherwise r = x.
    """
    if residual is not None:
        r = (x.float() + residual.float()).to(x.dtype)
    else:
        r = x
    rf = r.float()
    inv_rms = torch.rsqrt(rf.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = (rf * inv_rms * weight.float()).to(x.dtype)
    return (y, r) if residual is not None else y


def rotary_embedding_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding (rotate halves) in fp32; returns new tensors, inputs untouched."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions]  # [N, D]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def paged_prefill_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (fp32 math).
    `softcap` as for the decode reference.

    Sequence s owns q rows [query_start_loc[s], query_start_loc[s+1]); they are
    the last positions of its context_lens[s] tokens, whose K/V are all in the
    cache. Loops over sequences (a prefill batch has few).
    """
    _, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    flat = kv_cache.reshape(2, -1, num_kv_heads, head_dim)
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        if end == begin:
            continue
        positions = torch.arange(context_len, device=q.device)
        slots = block_tables[seq].to(torch.int64)[positions // block_size] * block_size
        slots = slots + positions % block_size
        keys = flat[0][slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = flat[1][slots].float().repeat_interleave(group, dim=1)
        query_pos = torch.arange(context_len - (end - begin), context_len, device=q.device)
        visible = positions[None, :] <= query_pos[:, None]
        if sliding_window is not None:
            visible &= positions[None, :] > query_pos[:, None] - sliding_window
        scores = soft_cap(torch.einsum("qhd,khd->hqk", q[begin:end].float(), keys) * scale,
                          softcap)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def logit_stats_reference(x: torch.Tensor, *, logsum: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per row of x [n, V] float32: the first index of its maximum (the
    first NaN's when it has one), that maximum (NaN then), and, when
    `logsum`, log(sum_j exp(x_j - max)) (NaN for a row with a NaN, +inf, or
    only -inf)."""
    argmax = x.argmax(dim=-1)
    top = x.amax(dim=-1)
    if not logsum:
        return argmax, top, None
    return argmax, top, (x - top[:, None]).exp().sum(dim=-1).log()

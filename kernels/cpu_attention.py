"""Paged decode attention for CPU pods: whole blocks gathered, then one fused SDPA call.

The torch reference (`kernels.reference.paged_decode_attention_reference`)
gathers K and V one token slot at a time, upcasts them to float32 and runs
two einsums; on a 2-core CPU that cost ~3.7 ms per layer at batch 8 and
~300 tokens of context, more than the layer's matmuls. This path:

1. gathers each sequence's blocks as whole blocks (one `index_select` over
   the cache viewed as [2, num_blocks, block_size * Hkv * D] copies
   contiguous runs instead of one row per token, and needs no per-token
   index arithmetic);
2. views them as [B, Hkv, L, D] without a further copy and calls
   `F.scaled_dot_product_attention` once with GQA grouping folded into the
   query ([B, Hkv, group, D]), so torch's fused CPU kernel computes scores,
   softmax and the weighted sum in one pass with float32 accumulation;
3. masks positions at or past each context length (and outside a sliding
   window) with a boolean mask; rows with context 0 return zeros.

Same contract as `kernels.dispatch.paged_decode_attention`. Chosen by
`dispatch` for CPU tensors under backend ``auto``; backend ``torch`` keeps the
reference. Checked against the reference in tests/kernels/test_cpu_attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention_cpu(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D] in q's dtype (arguments checked by `kernels.checks`)."""
    batch, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    if batch == 0:
        return torch.zeros_like(q)
    lens = context_lens.to(torch.int64)
    max_len = min(int(lens.max()), block_tables.shape[1] * block_size)
    if max_len == 0:
        return torch.zeros_like(q)
    num_blocks = -(-max_len // block_size)
    # Table entries past a sequence's last block may be garbage (the contract
    # lets callers pad with anything): clamp so the gather stays in bounds;
    # those positions are masked out below.
    table = block_tables[:, :num_blocks].to(torch.int64).clamp_(0, kv_cache.shape[1] - 1)
    width = num_blocks * block_size
    # index_select over flattened blocks: ~5x faster than advanced indexing here.
    gathered = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, table.view(-1))
    gathered = gathered.view(2, batch, width, num_kv_heads, head_dim)
    keys, values = gathered[0].transpose(1, 2), gathered[1].transpose(1, 2)
    positions = torch.arange(width)
    visible = positions[None, :] < lens[:, None]  # [B, L]
    if sliding_window is not None:
        visible &= positions[None, :] >= lens[:, None] - sliding_window
    empty = lens == 0
    has_empty = bool(empty.any())
    if has_empty:
        visible[empty, 0] = True  # softmax over nothing is NaN; the row is zeroed below
    query = q.view(batch, num_kv_heads, group, head_dim)
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    out = F.scaled_dot_product_attention(query, keys, values,
                                         attn_mask=visible[:, None, None, :], scale=scale)
    out = out.reshape(batch, num_q_heads, head_dim)
    if has_empty:
        out[empty] = 0
    return out

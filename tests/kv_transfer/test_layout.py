"""KVLayout's two byte maps: the whole-model (TP=1) form and the head-ranged one."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.layout import KVLayout
from kv_transfer.outgoing import plan_pieces


def _land(layout: KVLayout, kv: torch.Tensor, cuts: list[int],
          parts: list[tuple[int, int]]) -> torch.Tensor:  # fmt: skip
    """Write layer 0 of `kv` [2, T, H, D] into a fresh landing layer the way a
    sender's pieces do: one chunk per token range and head part, staged, sliced
    by plan_pieces; returns the listener's view of the landed bytes."""
    flat = torch.zeros(layout.bytes_per_layer, dtype=torch.uint8)
    bounds = [0, *cuts, layout.num_tokens]
    for s, e in parts:
        for a, b in zip(bounds, bounds[1:], strict=False):
            chunk = kv[:, a:b, s:e]
            staged = layout.staged(chunk).contiguous().view(-1).view(torch.uint8)
            heads = None if (s, e) == (0, layout.num_kv_heads) else (s, e)
            for p in plan_pieces(layout, 0, a, b - a, 3, 4096, 0, heads):
                flat[p.offset : p.offset + p.length] = staged[p.src_start : p.src_start + p.length]
    return layout.layer_view(flat)


def test_whole_model_form_is_unchanged():
    layout = KVLayout(32, 2000, 8, 128, "bfloat16")
    assert not layout.head_ranged
    assert layout.row_bytes == 8 * 128 * 2
    assert layout.rows_per_layer == 4000
    assert layout.chunk_runs(0, 2000) == [(0, 0, 4000)]
    assert layout.chunk_runs(10, 5) == [(0, 10, 5), (5, 2010, 5)]
    kv = torch.randn(2, 2000, 8, 128).to(torch.bfloat16)
    assert layout.staged(kv) is kv


def test_head_ranged_sizes_and_runs():
    layout = KVLayout(2, 10, 3, 4, "float32", head_start=3, model_kv_heads=6)
    assert layout.head_ranged
    assert layout.row_bytes == 16  # one head's one token
    assert layout.rows_per_layer == 2 * 10 * 3
    assert layout.bytes_per_layer == 2 * 10 * 3 * 4 * 4
    assert layout.layer_shape == (2, 10, 3, 4)
    assert layout.head_bytes(1, 3) == (1 * 20 * 16, 3 * 20 * 16)
    # every token of heads [1, 3): one run from head 1's first row
    assert layout.chunk_runs(0, 10, (1, 3)) == [(0, 20, 40)]
    # tokens [4, 6) of heads [1, 3): K and V runs per head
    assert layout.chunk_runs(4, 2, (1, 3)) == [(0, 24, 2), (2, 34, 2), (4, 44, 2), (6, 54, 2)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cuts", [[], [1], [3, 7]])
@pytest.mark.parametrize("parts", [[(0, 3)], [(0, 1), (1, 3)], [(2, 3), (0, 1), (1, 2)]])
def test_head_ranged_bytes_land_where_the_view_reads_them(dtype, cuts, parts):
    layout = KVLayout(1, 11, 3, 8, dtype, head_start=0, model_kv_heads=3)
    kv = torch.randn(2, 11, 3, 8, generator=torch.Generator().manual_seed(7)).to(
        layout.torch_dtype)
    view = _land(layout, kv, cuts, parts)
    assert view.shape == (2, 11, 3, 8) and not view.is_contiguous()
    assert torch.equal(view, kv)


def test_whole_model_bytes_land_where_the_view_reads_them():
    layout = KVLayout(1, 9, 2, 4, "float16")
    kv = torch.randn(2, 9, 2, 4).to(torch.float16)
    assert torch.equal(_land(layout, kv, [4], [(0, 2)]), kv)


def test_heads_and_chunks_are_checked():
    layout = KVLayout(2, 10, 4, 8, "float32", head_start=4, model_kv_heads=8)
    layout.check_chunk(1, torch.zeros(2, 3, 2, 8), 7, heads=(2, 4))
    with pytest.raises(ValueError, match=r"shape \[2, n, 2, 8\]"):
        layout.check_chunk(1, torch.zeros(2, 3, 4, 8), 7, heads=(2, 4))
    with pytest.raises(ValueError, match="not inside"):
        layout.heads((3, 5))
    whole = KVLayout(2, 10, 4, 8, "float32")
    with pytest.raises(ValueError, match="only a head-ranged layout"):
        whole.heads((0, 2))
    assert whole.heads(None) == (0, 4) == whole.heads((0, 4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(head_start=1), "needs model_kv_heads"),
        (dict(head_start=6, model_kv_heads=7), r"\[6, 8\) are not inside the model's 7"),
        (dict(model_kv_heads=-1), "model_kv_heads"),
    ],
)
def test_head_fields_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVLayout(2, 4, 2, 8, "float32", **kwargs)


def test_describe_and_accepts():
    decode = KVLayout(30, 3, 2, 64, "bfloat16", head_start=0, model_kv_heads=4)
    assert decode.describe() == "30 layers x 3 tokens from 0 x KV heads [0, 2) of 4 x 64 bfloat16"
    whole = KVLayout(30, 3, 4, 64, "bfloat16")
    assert whole.describe() == (
        "30 layers x 3 tokens from 0 x KV heads [0, 4) of 4 (whole model) x 64 bfloat16")
    assert whole.accepts(whole)
    # a TP=1 decode pod takes the head-major form of all its heads (a TP > 1 prefill)
    assert whole.accepts(whole.head_major())
    assert whole.head_major() == KVLayout(30, 3, 4, 64, "bfloat16", model_kv_heads=4)
    assert not whole.accepts(decode)
    assert not decode.accepts(whole)


def test_head_share():
    whole = KVLayout(4, 9, 8, 16, "float16", token_offset=16)
    assert whole.head_share(2, 4) == KVLayout(4, 9, 2, 16, "float16", 16, head_start=2,
                                              model_kv_heads=8)
    with pytest.raises(ValueError, match="whole-model"):
        whole.head_share(2, 4).head_share(0, 1)

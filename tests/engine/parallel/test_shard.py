"""`ShardLayout` and `check_shardable` on their own (no processes): which
heads, intermediate columns and vocabulary rows each rank holds, what it
reads of each checkpoint tensor, and the models refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.errors import UnsupportedModelError
from engine.make_model import SIZES
from engine.model_config import ModelConfig
from engine.parallel.shard import (
    Selection,
    ShardLayout,
    Split,
    check_shardable,
    kv_head_range,
)


def _config(size: str = "tiny", **fields) -> ModelConfig:
    raw = {**SIZES[size], "architectures": ["LlamaForCausalLM"], "vocab_size": 1001,
           **fields}
    return ModelConfig.from_dict(raw)


def test_single_layout_is_the_whole_model():
    config = _config()
    layout = ShardLayout.single(config)
    assert (layout.rank, layout.size, layout.num_heads, layout.num_kv_heads) == (0, 1, 4, 2)
    assert (layout.kv_head_start, layout.kv_head_end) == (0, 2)
    assert (layout.vocab_start, layout.vocab_end, layout.vocab_shard) == (0, 1001, 1001)
    assert layout.intermediate_size == 256
    assert layout.local_config(config) is config
    assert all(layout.selection(split, config) is None for split in Split)


def test_tiny_at_tp2_splits_heads_intermediate_and_padded_vocab():
    config = _config()
    layouts = [ShardLayout.for_rank(config, rank, 2) for rank in range(2)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start, s.kv_head_end)
            for s in layouts] == [(2, 1, 0, 1), (2, 1, 1, 2)]
    assert [s.intermediate_size for s in layouts] == [128, 128]
    # 1001 rows: 501 per shard, the last shard's final row is padding
    assert [(s.vocab_start, s.vocab_end, s.vocab_shard) for s in layouts] == [
        (0, 501, 501), (501, 1001, 501)]
    local = layouts[1].local_config(config)
    assert (local.num_attention_heads, local.num_key_value_heads,
            local.intermediate_size) == (2, 1, 128)
    assert (local.head_dim, local.hidden_size, local.vocab_size) == (64, 128, 1001)


def test_kv_heads_replicate_when_ranks_outnumber_them():
    # tiny at TP=4: 2 KV heads, each on 2 ranks; each rank 1 q head of its group
    config = _config()
    layouts = [ShardLayout.for_rank(config, rank, 4) for rank in range(4)]
    assert [(s.kv_head_start, s.kv_head_end) for s in layouts] == [(0, 1), (0, 1), (1, 2),
                                                                   (1, 2)]
    assert [s.q_head_start for s in layouts] == [0, 1, 2, 3]
    assert [kv_head_range(4, rank, 8) for rank in range(8)] == [
        (0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4), (3, 4)]
    assert [kv_head_range(8, rank, 4) for rank in range(4)] == [(0, 2), (2, 4), (4, 6),
                                                                (6, 8)]


def test_base_at_tp2_and_tp4_keeps_gqa_groups_whole():
    config = _config("base")  # 16 q heads over 4 KV heads: groups of 4
    for size in (2, 4, 8, 16):
        for rank in range(size):
            s = ShardLayout.for_rank(config, rank, size)
            first_kv = s.q_head_start // 4
            last_kv = (s.q_head_start + s.num_heads - 1) // 4
            assert s.kv_head_start <= first_kv and last_kv < s.kv_head_end


def test_selection_of_each_split_at_rank_1_of_2():
    config = _config()  # q 4x64 = 256 rows, kv 2x64 = 128, intermediate 256
    layout = ShardLayout.for_rank(config, 1, 2)
    assert layout.selection(Split.REPLICATED, config) is None
    assert layout.selection(Split.Q_HEADS, config) == Selection(((128, 256),))
    assert layout.selection(Split.KV_HEADS, config) == Selection(((64, 128),))
    assert layout.selection(Split.QKV_HEADS, config) == Selection(
        ((128, 256), (256 + 64, 256 + 128), (384 + 64, 384 + 128)))
    assert layout.selection(Split.INTERMEDIATE, config) == Selection(((128, 256),))
    assert layout.selection(Split.GATE_UP, config) == Selection(((128, 256), (384, 512)))
    assert layout.selection(Split.Q_COLUMNS, config) == Selection(None, (128, 256))
    assert layout.selection(Split.INTERMEDIATE_COLUMNS, config) == Selection(None, (128, 256))
    assert layout.selection(Split.VOCAB, config) == Selection(((501, 1001),))


@pytest.mark.parametrize(("fields", "size", "message"), [
    ({}, 3, "cannot shard LlamaForCausalLM across tensor-parallel size 3: "
            "num_attention_heads 4 is not divisible by 3"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, 2,
     "num_key_value_heads 3 is neither divisible by 2 nor a divisor of it"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, 4,
     "num_key_value_heads 3 is neither divisible by 4 nor a divisor of it"),
    ({"intermediate_size": 250}, 4,
     "tensor-parallel size 4: intermediate_size 250 is not divisible by 4"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
      "num_experts_per_tok": 2, "intermediate_size": 258}, 4,
     "intermediate_size 258 (of each of the 4 experts) is not divisible by 4"),
])
def test_unshardable_models_are_refused_by_name(fields, size, message):
    config = _config(**fields)
    with pytest.raises(UnsupportedModelError) as info:
        check_shardable(config, size)
    assert message in str(info.value)
    with pytest.raises(UnsupportedModelError):
        ShardLayout.for_rank(config, 0, size)


def test_bad_sizes_and_ranks_are_value_errors():
    config = _config()
    with pytest.raises(ValueError, match="tensor-parallel size must be >= 1, got 0"):
        check_shardable(config, 0)
    with pytest.raises(ValueError, match=r"rank 2 must be in \[0, size 2\)"):
        ShardLayout.for_rank(config, 2, 2)
    with pytest.raises(ValueError, match="are not 2 heads"):
        replace(ShardLayout.single(config), num_kv_heads=2, kv_head_end=1)

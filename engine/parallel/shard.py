"""How one model splits across the N ranks of a tensor-parallel pod.

Megatron/vLLM style (docs/tensor_parallel.md, "Sharded model"):

- Column-parallel (each rank a slice of the output rows, no communication):
  the merged `qkv_proj` (this rank's q heads' rows, then its KV heads' k
  rows, then their v rows; biases alike) and `gate_up_proj` (this rank's
  intermediate slice of the gate rows, then the same slice of the up rows).
- Row-parallel (each rank a slice of the input columns, then one all-reduce
  of the output): `o_proj` (the columns of this rank's q heads) and
  `down_proj` (its intermediate slice). A Mixtral expert is split like an
  MLP, the router is replicated, and the MoE block all-reduces once.
- Vocab-parallel: rank r holds rows [r * S, (r + 1) * S) of the embedding
  and of lm_head, S = ceil(vocab / N) (`vocab_shard`; the rows past the
  vocabulary are zeros).
- KV heads: rank r holds [r * H / N, (r + 1) * H / N) when N divides H, and
  head r * H // N when H divides N (each head then replicated on N / H
  ranks). Query heads split evenly, so rank r's q heads use exactly the KV
  heads it holds (checked in `ShardLayout.for_rank`).
- Everything else (norms, q/k norms, the router) is replicated.

`ShardLayout` is computed once per rank at load time from the full
`ModelConfig` and immutable; the loader reads it to take each checkpoint
tensor's slice (`ShardLayout.selection`), the model to size its layers
(`local_config`), and the engine to size the KV cache (`num_kv_heads`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from engine.errors import UnsupportedModelError
from engine.model_config import ModelConfig


class Split(enum.Enum):
    """How a checkpoint tensor splits across ranks (rows are dim 0)."""

    REPLICATED = "replicated"  # the whole tensor on every rank
    Q_HEADS = "q_heads"  # rows of this rank's q heads (q_proj weight, bias)
    KV_HEADS = "kv_heads"  # rows of this rank's KV heads (k_proj, v_proj)
    QKV_HEADS = "qkv_heads"  # Phi-3's fused [q; k; v]: the three row ranges
    INTERMEDIATE = "intermediate"  # rows of this rank's intermediate slice (gate, up)
    GATE_UP = "gate_up"  # Phi-3's fused [gate; up]: the slice of each half
    Q_COLUMNS = "q_columns"  # o_proj: the columns of this rank's q heads
    INTERMEDIATE_COLUMNS = "intermediate_columns"  # down_proj's columns
    VOCAB = "vocab"  # embedding / lm_head rows of this rank's vocabulary range


@dataclass(frozen=True, slots=True)
class Selection:
    """The part of a checkpoint tensor a rank reads: the row ranges
    [start, end) in order, concatenated (None: every row), and one column
    range (None: every column)."""

    rows: tuple[tuple[int, int], ...] | None
    cols: tuple[int, int] | None = None


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the KV heads rank `rank` of `size` holds (the rule in
    the module docstring; N > H replicates, so ranges of ranks may coincide)."""
    if size <= num_kv_heads:
        per_rank = num_kv_heads // size
        return rank * per_rank, (rank + 1) * per_rank
    head = rank * num_kv_heads // size
    return head, head + 1


def check_shardable(config: ModelConfig, size: int) -> None:
    """UnsupportedModelError naming the field, its value and the TP size when
    `config`'s model cannot be split across `size` ranks; ValueError for a
    size below 1."""
    if size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {size}")
    if size == 1:
        return
    where = f"cannot shard {config.architecture} across tensor-parallel size {size}"
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise UnsupportedModelError(
            f"{where}: num_attention_heads {heads} is not divisible by {size}")
    if kv_heads % size and size % kv_heads:
        raise UnsupportedModelError(
            f"{where}: num_key_value_heads {kv_heads} is neither divisible by {size} "
            f"nor a divisor of it (a KV head is split across no rank, only replicated)")
    if config.intermediate_size % size:
        what = (f"intermediate_size {config.intermediate_size} (of each of the "
                f"{config.num_local_experts} experts)" if config.num_local_experts
                else f"intermediate_size {config.intermediate_size}")
        raise UnsupportedModelError(f"{where}: {what} is not divisible by {size}")


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """One rank's part of the model. Head and intermediate counts are this
    rank's; `kv_head_start`/`kv_head_end` place its KV heads in the full
    model (what its KV cache holds, and what the KV transfer sends);
    `vocab_start`/`vocab_end` its real vocabulary rows, `vocab_shard` the
    padded width every rank's embedding and logits have."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    kv_head_end: int
    intermediate_size: int
    vocab_start: int
    vocab_end: int
    vocab_shard: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} must be in [0, size {self.size})")
        if self.kv_head_end - self.kv_head_start != self.num_kv_heads:
            raise ValueError(f"KV heads [{self.kv_head_start}, {self.kv_head_end}) are not "
                             f"{self.num_kv_heads} heads")
        if not 0 <= self.vocab_end - self.vocab_start <= self.vocab_shard:
            raise ValueError(f"vocab rows [{self.vocab_start}, {self.vocab_end}) do not fit "
                             f"the shard width {self.vocab_shard}")

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int, size: int) -> ShardLayout:
        """Rank `rank`'s layout at TP size `size` (`check_shardable` first)."""
        check_shardable(config, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} must be in [0, size {size})")
        heads = config.num_attention_heads // size
        kv_start, kv_end = kv_head_range(config.num_key_value_heads, rank, size)
        group = config.num_attention_heads // config.num_key_value_heads
        q_start = rank * heads
        used = (q_start // group, (q_start + heads - 1) // group + 1)
        if used[0] < kv_start or used[1] > kv_end:  # GQA: a q head must find its KV head here
            raise UnsupportedModelError(
                f"cannot shard {config.architecture} across tensor-parallel size {size}: "
                f"rank {rank}'s q heads [{q_start}, {q_start + heads}) use KV heads "
                f"[{used[0]}, {used[1]}) but it holds [{kv_start}, {kv_end})")
        vocab_shard = -(-config.vocab_size // size)
        return cls(rank=rank, size=size, num_heads=heads, num_kv_heads=kv_end - kv_start,
                   kv_head_start=kv_start, kv_head_end=kv_end,
                   intermediate_size=config.intermediate_size // size,
                   vocab_start=min(rank * vocab_shard, config.vocab_size),
                   vocab_end=min((rank + 1) * vocab_shard, config.vocab_size),
                   vocab_shard=vocab_shard)

    @classmethod
    def single(cls, config: ModelConfig) -> ShardLayout:
        """The whole model on one rank (no tensor parallelism)."""
        return cls.for_rank(config, 0, 1)

    @property
    def q_head_start(self) -> int:
        return self.rank * self.num_heads

    @property
    def intermediate_start(self) -> int:
        return self.rank * self.intermediate_size

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """`config` with this rank's head, KV-head and intermediate counts:
        what its layers are built from (head_dim, vocab and the rest stay)."""
        if self.size == 1:
            return config
        return replace(config, num_attention_heads=self.num_heads,
                       num_key_value_heads=self.num_kv_heads,
                       intermediate_size=self.intermediate_size)

    def selection(self, split: Split, config: ModelConfig) -> Selection | None:
        """What this rank reads of a tensor split as `split` of the full
        `config`'s model; None for the whole tensor."""
        if self.size == 1 or split is Split.REPLICATED:
            return None
        d = config.head_dim
        q = (self.q_head_start * d, (self.q_head_start + self.num_heads) * d)
        kv = (self.kv_head_start * d, self.kv_head_end * d)
        inter = (self.intermediate_start, self.intermediate_start + self.intermediate_size)
        if split is Split.Q_HEADS:
            return Selection((q,))
        if split is Split.KV_HEADS:
            return Selection((kv,))
        if split is Split.QKV_HEADS:
            k_at, v_at = config.q_size, config.q_size + config.kv_size
            return Selection((q, (k_at + kv[0], k_at + kv[1]), (v_at + kv[0], v_at + kv[1])))
        if split is Split.INTERMEDIATE:
            return Selection((inter,))
        if split is Split.GATE_UP:
            up_at = config.intermediate_size
            return Selection((inter, (up_at + inter[0], up_at + inter[1])))
        if split is Split.Q_COLUMNS:
            return Selection(None, q)
        if split is Split.INTERMEDIATE_COLUMNS:
            return Selection(None, inter)
        if split is Split.VOCAB:
            return Selection(((self.vocab_start, self.vocab_end),))
        raise AssertionError(f"unhandled split {split}")

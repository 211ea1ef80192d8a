"""The places a sharded model talks to its other ranks (engine/parallel/
shard.py has the layout): a row-parallel `Linear`, whose input columns are
this rank's slice and whose partial output is summed over the ranks, the
vocab-parallel embedding lookup, and the gather of the vocabulary shards'
logits (`model_logits`); and `shard_of`, the layout a model class builds
itself from.

The first two all-reduce inside the model's forward, so a captured CUDA
graph holds them (NCCL collectives capture); the gather runs in
`compute_logits`, outside it. Without a group (`tp is None`: one rank) each
is the plain op, with no collective, mask or copy added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.linear import Linear
from engine.model_config import ModelConfig
from engine.parallel.group import TPGroup
from engine.parallel.shard import ShardLayout


def shard_of(config: ModelConfig, tp: TPGroup | None) -> ShardLayout:
    """This rank's layout of `config`'s model: the whole model without a group."""
    return ShardLayout.single(config) if tp is None else ShardLayout.for_rank(
        config, tp.rank, tp.size)


class RowParallelLinear(Linear):
    """y = all_reduce(x_local W_local^T): `x` holds this rank's slice of the
    input features, `weight` the matching columns. No bias: none of the
    families has one on a row-parallel projection (it would be added on one
    rank only). Packs like any `Linear` (`prepack`)."""

    def __init__(self, in_features: int, out_features: int, *, tp: TPGroup,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=dtype, device=device)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


def row_linear(in_features: int, out_features: int, *, tp: TPGroup | None,
               dtype: torch.dtype, device: torch.device | str) -> Linear:
    """o_proj / down_proj: row-parallel under a group, a plain `Linear` without."""
    if tp is None:
        return Linear(in_features, out_features, bias=False, dtype=dtype, device=device)
    return RowParallelLinear(in_features, out_features, tp=tp, dtype=dtype, device=device)


def embed_tokens(input_ids: torch.Tensor, weight: torch.Tensor, shard: ShardLayout,
                 tp: TPGroup | None) -> torch.Tensor:
    """Embeddings [N, hidden] of `input_ids` from `weight`, this rank's
    vocabulary rows: an id outside [vocab_start, vocab_end) looks up row 0
    and is zeroed, so the sum over the ranks is exactly the one row that
    holds it."""
    if tp is None:
        return F.embedding(input_ids, weight)
    outside = (input_ids < shard.vocab_start) | (input_ids >= shard.vocab_end)
    local_ids = (input_ids - shard.vocab_start).masked_fill(outside, 0)
    out = F.embedding(local_ids, weight)
    out.masked_fill_(outside.unsqueeze(-1), 0.0)
    return tp.all_reduce(out)


def model_logits(logits: torch.Tensor, tp: TPGroup | None, vocab_size: int
                 ) -> torch.Tensor | None:
    """A model's float32 logits from this rank's vocabulary shard of them:
    as they are on one rank; under a group rank 0 gets them gathered
    [n, vocab_size], the other ranks (which must call it too) None."""
    return logits if tp is None else tp.gather_logits(logits, vocab_size)

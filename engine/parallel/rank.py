"""What every rank of a pod builds at start: its shard of the model, its KV
cache and its `ModelRunner`. Rank 0 (`LLMEngine.__init__`) and each worker
(`engine.parallel.worker`) call `build_rank` after joining the group, and
build in the same order, because the steps involved are collectives: the
KV block count is the minimum over the ranks (`TPGroup.min_int`: on CUDA
each rank measures its own free memory, and block ids must mean the same
slots everywhere), and the runner captures the decode CUDA graphs, one
forward per bucket, on every rank the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.engine_setup import EngineModel, allocate_engine_kv, load_engine_model
from engine.kv_hook import LayerKVHook
from engine.model_runner import ModelRunner
from engine.parallel.group import TPGroup


@dataclass(frozen=True, slots=True)
class RankModel:
    """One rank's model, cache and runner."""

    loaded: EngineModel
    kv_caches: list[torch.Tensor]
    num_blocks: int  # the same on every rank of the pod
    runner: ModelRunner


def build_rank(config: EngineConfig, tp: TPGroup | None, *,
               layer_kv_hook: LayerKVHook | None = None,
               async_inputs: bool = False) -> RankModel:
    """Load this rank's shard (the whole model without `tp`), allocate its KV
    cache and build its runner. `async_inputs`: steps are prepared while
    another is in flight (rank 0 under async scheduling)."""
    loaded = load_engine_model(config, tp=tp)
    kv_caches, num_blocks = _allocate_kv(config, loaded, tp)
    runner = ModelRunner(loaded.model, kv_caches, config.block_size,
                         layer_kv_hook=layer_kv_hook, max_num_seqs=config.max_num_seqs,
                         max_num_batched_tokens=config.max_num_batched_tokens,
                         max_model_len=loaded.max_model_len,
                         enforce_eager=config.enforce_eager, async_scheduling=async_inputs,
                         rank=0 if tp is None else tp.rank)
    return RankModel(loaded, kv_caches, num_blocks, runner)


def _allocate_kv(config: EngineConfig, loaded: EngineModel,
                 tp: TPGroup | None) -> tuple[list[torch.Tensor], int]:
    heads = loaded.model.shard.num_kv_heads  # this rank's
    caches, num_blocks = allocate_engine_kv(config, loaded.model_config, loaded.model.dtype,
                                            heads)
    if tp is None:
        return caches, num_blocks
    common = tp.min_int(num_blocks)
    if common == num_blocks:
        return caches, num_blocks
    del caches  # a rank with more room allocates the common count (freed first)
    return allocate_engine_kv(dataclasses.replace(config, num_blocks=common),
                              loaded.model_config, loaded.model.dtype, heads)

"""What an `LLMEngine` is built on, from its config: the model on its matmul
backend, its context limit and stop tokens, and the paged KV cache sized to
the memory budget. Called once, by `LLMEngine.__init__`; anything refused
here is refused at start, not at the first step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.errors import UnsupportedModelError
from engine.kv_cache import allocate_kv_caches, kv_bytes_per_block, num_blocks_for_budget
from engine.layers.linear import MatmulBackend, prepack, resolve_backend, resolve_decode_matmul
from engine.loader import load_model
from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.parallel.group import TPGroup
from kernels import host_malloc, native
from kernels.checks import HEAD_DIMS
from kernels.dispatch import Backend


@dataclass(frozen=True, slots=True)
class EngineModel:
    """The loaded model, prepacked for its backend, and its limits."""

    model: LlamaForCausalLM
    model_config: ModelConfig
    matmul_backend: MatmulBackend
    # every projection on the native panel GEMM (float32 CPU), or oneDNN's
    native_gemm: bool
    max_model_len: int
    # the config's and generation_config.json's (which HF generation also stops on)
    eos_token_ids: frozenset[int]


def load_engine_model(config: EngineConfig, tp: TPGroup | None = None) -> EngineModel:
    """Load (under `tp` this rank's shard: `model.shard`; `model_config`
    stays the full model's) and prepack the model; UnsupportedModelError for
    a head size the paged attention kernels do not take or a model `tp`
    cannot split, ValueError for a max_model_len above the model's limit."""
    model, mc = load_model(config.model_dir, dtype=config.dtype, device=config.device,
                           kernel_backend=config.kernel_backend, tp=tp)
    matmul_backend = resolve_backend(config.matmul_backend, model.dtype, model.device)
    native_gemm = resolve_decode_matmul(config.decode_matmul, model.dtype, model.device,
                                        matmul_backend)
    prepack(model, matmul_backend, native_gemm)
    if model.device.type == "cpu":
        host_malloc.keep_freed_memory()  # no page faults between a step's layers
        if Backend.parse(config.kernel_backend) is Backend.AUTO:
            native.library()  # build or load the CPU attention now, not in the first step
    if mc.head_dim not in HEAD_DIMS:
        raise UnsupportedModelError(
            f"{config.model_dir}: head_dim={mc.head_dim} is not supported by the paged "
            f"attention kernels (supported: {', '.join(map(str, HEAD_DIMS))})")
    limit, limit_source = mc.context_limit()
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                         f"{limit_source} {limit}")
    return EngineModel(model, mc, matmul_backend, native_gemm, config.max_model_len or limit,
                       frozenset(mc.eos_token_ids) | _generation_eos_ids(config.model_dir))


def allocate_engine_kv(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype,
                       num_kv_heads: int) -> tuple[list[torch.Tensor], int]:
    """The per-layer paged KV caches for the config's memory budget, and
    their number of blocks. `num_kv_heads` is the KV heads this process
    holds (`model.shard.num_kv_heads`: all of them without tensor
    parallelism)."""
    per_block = kv_bytes_per_block(num_layers=mc.num_hidden_layers,
                                   block_size=config.block_size,
                                   num_kv_heads=num_kv_heads,
                                   head_dim=mc.head_dim, dtype=dtype)
    num_blocks = num_blocks_for_budget(config, per_block)
    caches = allocate_kv_caches(
        num_layers=mc.num_hidden_layers, num_blocks=num_blocks,
        block_size=config.block_size, num_kv_heads=num_kv_heads,
        head_dim=mc.head_dim, dtype=dtype, device=config.device)
    return caches, num_blocks


def _generation_eos_ids(model_dir: str) -> frozenset[int]:
    """eos ids of generation_config.json, which HF generation also stops on."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return frozenset()
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    return frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)

"""The paged KV cache tensors: sized once at start, never grown.

Per layer one tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = K, 1 = V); token slot = `block_id * block_size + offset`
(docs/architecture.md "KV cache"). Built by `LLMEngine.__init__`; written
and read on the engine loop thread (and by a decode pod's injector through
`kernels.inject_kv`, into slots it reserved).
"""

from __future__ import annotations

import torch

from engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from kernels import huge_pages


def kv_bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


def num_blocks_for_budget(config: EngineConfig, bytes_per_block: int) -> int:
    """Blocks that fit the configured budget (see `EngineConfig` for precedence).

    Call after the weights are loaded: on CUDA the fraction applies to the
    device memory still free then.
    """
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif config.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        budget = int(free * config.gpu_memory_fraction)
    else:
        budget = DEFAULT_CPU_KV_CACHE_MEMORY
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes is below one block ({bytes_per_block} bytes "
            f"at block_size {config.block_size}); raise kv_cache_memory"
        )
    return num_blocks


def allocate_kv_caches(*, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype,
                       device: torch.device | str) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer. Zeroed so that slots never written
    hold finite values (a masked-out 0 * garbage could still be NaN)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":  # swept by every decode step: huge pages
        return [huge_pages.zeros(shape, dtype) for _ in range(num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

import pytest
import torch

from engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from engine.kv_cache import allocate_kv_caches, kv_bytes_per_block, num_blocks_for_budget
from kernels import huge_pages


def test_bytes_per_block_and_budget():
    per_block = kv_bytes_per_block(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64,
                                   dtype=torch.float16)
    assert per_block == 2 * 2 * 16 * 2 * 64 * 2
    assert num_blocks_for_budget(EngineConfig(model_dir="m", num_blocks=7), per_block) == 7
    cfg = EngineConfig(model_dir="m", kv_cache_memory=per_block * 10 + 5)
    assert num_blocks_for_budget(cfg, per_block) == 10
    cpu_default = num_blocks_for_budget(EngineConfig(model_dir="m"), per_block)
    assert cpu_default == DEFAULT_CPU_KV_CACHE_MEMORY // per_block
    with pytest.raises(ValueError, match="below one block"):
        num_blocks_for_budget(EngineConfig(model_dir="m", kv_cache_memory=100), per_block)


def test_allocation_shape_and_zeroed():
    caches = allocate_kv_caches(num_layers=3, num_blocks=5, block_size=16, num_kv_heads=2,
                                head_dim=8, dtype=torch.float32, device="cpu")
    assert len(caches) == 3 and caches[0].shape == (2, 5, 16, 2, 8)
    assert all(c.count_nonzero() == 0 for c in caches)
    assert caches[0].data_ptr() != caches[1].data_ptr()


@pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here")
def test_cpu_caches_start_on_huge_pages():
    """A cache of a huge page or more is mapped for 2 MiB pages (kernels/huge_pages.py)."""
    caches = allocate_kv_caches(num_layers=2, num_blocks=64, block_size=128, num_kv_heads=2,
                                head_dim=64, dtype=torch.float32, device="cpu")
    for c in caches:
        assert c.data_ptr() % huge_pages.HUGE_PAGE == 0 and c.is_contiguous()
        assert c.count_nonzero() == 0
    caches[0][1, 3] = 1.0  # the layers are separate memory
    assert caches[1].count_nonzero() == 0

import pytest

from engine.config import EngineConfig


def test_defaults():
    c = EngineConfig(model_dir="m")
    assert (c.block_size, c.max_num_seqs, c.max_num_batched_tokens) == (16, 64, 2048)
    assert c.enable_prefix_caching and c.max_model_len is None
    # async scheduling: None resolves by device (on for CUDA; off on CPU, measured)
    assert c.async_scheduling is None and not c.use_async_scheduling
    assert EngineConfig(model_dir="m", device="cuda:1").use_async_scheduling
    assert EngineConfig(model_dir="m", async_scheduling=True).use_async_scheduling
    assert c.enforce_eager is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"model_dir": ""}, "model_dir"), ({"dtype": "int8"}, "dtype"),
     ({"device": "tpu"}, "device"),
     ({"block_size": 8}, r"block_size must be a power of two in \[16, 256\], got 8"),
     ({"block_size": 48}, "block_size"), ({"block_size": 512}, "block_size"),
     ({"kv_cache_memory": 0}, "kv_cache_memory"), ({"num_blocks": 0}, "num_blocks"),
     ({"gpu_memory_fraction": 1.5}, "gpu_memory_fraction"),
     ({"max_num_seqs": 0}, "max_num_seqs"),
     ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
     ({"max_model_len": 0}, "max_model_len"), ({"seed": -1}, "seed"),
     ({"enforce_eager": "yes"}, "enforce_eager must be a bool, got 'yes'")],
)
def test_bad_values_name_the_field(kwargs, message):
    fields = {"model_dir": "m", **kwargs}
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)

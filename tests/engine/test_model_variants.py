"""engine.model_variants: the architecture-dependent fields of config.json
(Qwen3, Phi-3, Mixtral), transformers 5's layout, and what is refused."""

from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig
from engine.errors import UnsupportedModelError
from engine.layers.rotary import cos_sin_cache_for, partial_rotary_order
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.model_variants import LongRopeScaling

BASE = {
    "vocab_size": 100, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 1024,
}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [4.0] * 32}


def _config(architecture: str, **fields) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, "architectures": [architecture], **fields},
                                 source="m/config.json")


def test_transformers5_rope_parameters_and_dtype() -> None:
    # save_pretrained in transformers 5 writes no top-level rope_theta.
    config = _config("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                     dtype="bfloat16", rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    assert config.rope_theta == 5e5 and config.rope_scaling is None
    assert config.torch_dtype == "bfloat16"
    # Mixtral's own defaults where the config says nothing.
    config = _config("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2)
    assert (config.rope_theta, config.rms_norm_eps) == (1e6, 1e-5)


def test_per_layer_rope_parameters_are_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="rope_parameters per layer type"):
        _config("LlamaForCausalLM", rope_parameters={
            "full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}})


def test_qwen3_fields_and_refusals() -> None:
    config = _config("Qwen3ForCausalLM", sliding_window=4096, use_sliding_window=False)
    assert config.qk_norm and config.sliding_window is None and not config.attention_bias
    with pytest.raises(UnsupportedModelError, match="attention_bias=True"):
        _config("Qwen3ForCausalLM", attention_bias=True)


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_window_applies_from_max_window_layers(architecture) -> None:
    on = {"sliding_window": 64, "use_sliding_window": True}
    # transformers' max_window_layers default (28) >= 2 layers: no layer slides.
    assert _config(architecture, **on).sliding_window is None
    assert _config(architecture, **on, max_window_layers=0).sliding_window == 64
    assert _config(architecture, **on, layer_types=["sliding_attention"] * 2).sliding_window == 64
    with pytest.raises(UnsupportedModelError) as info:
        _config(architecture, **on, max_window_layers=1)
    assert str(info.value) == (
        "m/config.json: use_sliding_window=True is not supported (the window applies to 1 of "
        "2 layers (max_window_layers / layer_types); the engine's window is the same for "
        "every layer)")


def test_phi3_longrope_defaults_follow_transformers() -> None:
    # "su" is the older name; original_max_position_embeddings from the top level.
    config = _config("Phi3ForCausalLM", original_max_position_embeddings=256, sliding_window=2047,
                     rope_scaling={"type": "su", "short_factor": [1.0] * 32,
                                   "long_factor": [4.0] * 32})
    scaling = config.rope_scaling
    assert isinstance(scaling, LongRopeScaling)
    assert scaling.original_max_position_embeddings == 256
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))
    assert config.sliding_window == 2047  # transformers masks every Phi-3 layer with it
    assert config.context_limit()[0] == 256
    # Without the top-level field Phi-3 means 4096 (Phi3Config's default).
    config = _config("Phi3ForCausalLM", rope_scaling=LONGROPE)
    assert config.context_limit()[0] == 4096
    with pytest.raises(ValueError, match="need 32"):
        _config("Phi3ForCausalLM", rope_scaling={**LONGROPE, "short_factor": [1.0] * 8,
                                                 "long_factor": [1.0] * 8})


def test_partial_rotary_only_for_phi3() -> None:
    config = _config("Phi3ForCausalLM", partial_rotary_factor=0.75)
    assert config.rotary_dim == 48
    with pytest.raises(UnsupportedModelError) as info:
        _config("LlamaForCausalLM", partial_rotary_factor=0.5)
    assert "partial_rotary_factor=0.5 is not supported" in str(info.value)


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Phi3ForCausalLM",
                                          "MixtralForCausalLM"])
def test_other_activations_are_refused(architecture) -> None:
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu' is not supported"):
        _config(architecture, hidden_act="gelu", num_local_experts=2, num_experts_per_tok=1)


def test_mixtral_expert_counts_checked() -> None:
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, "
                                         r"num_local_experts=4\], got 5"):
        _config("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=5)


def test_partial_rotary_table_and_order() -> None:
    # Rotated pairs (i, i + R/2) of the checkpoint land on (j, j + D/2).
    order = partial_rotary_order(8, 4)
    assert order == [0, 1, 4, 5, 2, 3, 6, 7]
    config = _config("Phi3ForCausalLM", partial_rotary_factor=0.5)  # head_dim 64, rotary 32
    table = cos_sin_cache_for(config)
    assert table.shape == (1024, 64)
    cos, sin = table[:, :32], table[:, 32:]
    assert (cos[:, 16:] == 1).all() and (sin[:, 16:] == 0).all()  # identity on passed dims
    assert cos[5, 1].item() == pytest.approx(math.cos(5 * 10000 ** (-2 / 32)), abs=1e-6)


def test_engine_refuses_context_beyond_longrope_original(tmp_path) -> None:
    from tests.engine.test_hf_parity import transformers  # skips without transformers

    config = transformers.Phi3Config(
        vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
        original_max_position_embeddings=256, pad_token_id=None, bos_token_id=0, eos_token_id=1,
        rope_scaling=LONGROPE)
    transformers.Phi3ForCausalLM(config).save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model_dir=str(tmp_path), num_blocks=8))
    assert engine.max_model_len == 256
    with pytest.raises(ValueError) as info:
        LLMEngine(EngineConfig(model_dir=str(tmp_path), num_blocks=8, max_model_len=512))
    assert str(info.value).startswith(
        "max_model_len 512 exceeds the model's rope_scaling 'longrope' "
        "original_max_position_embeddings")
    assert str(info.value).endswith(" 256")


def test_engine_refuses_head_dims_the_kernels_lack(tmp_path) -> None:
    from tests.engine.test_hf_parity import transformers  # skips without transformers

    config = transformers.Phi3Config(  # head_dim 80 (160 / 2): no kernel runs it
        vocab_size=64, hidden_size=160, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=None, bos_token_id=0,
        eos_token_id=1)
    transformers.Phi3ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as info:
        LLMEngine(EngineConfig(model_dir=str(tmp_path), num_blocks=8))
    assert str(info.value) == (f"{tmp_path}: head_dim=80 is not supported by the paged "
                               "attention kernels (supported: 64, 96, 128, 256)")

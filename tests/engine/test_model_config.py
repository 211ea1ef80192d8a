"""engine.model_config: parsing HF config.json dicts and refusing bad ones."""

from __future__ import annotations

import pytest

from engine.errors import CheckpointError, UnsupportedModelError
from engine.model_config import ModelConfig, RopeScaling

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def test_llama_defaults() -> None:
    config = ModelConfig.from_dict(BASE)
    assert config.head_dim == 16  # hidden / heads when not explicit
    assert config.eos_token_ids == (2,)
    assert (config.q_size, config.kv_size) == (64, 32)
    assert config.rope_scaling is None and config.sliding_window is None
    assert not config.attention_bias and not config.tie_word_embeddings


def test_explicit_head_dim_and_eos_list() -> None:
    config = ModelConfig.from_dict({**BASE, "head_dim": 64, "eos_token_id": [2, 3]})
    assert config.head_dim == 64 and config.q_size == 256
    assert config.eos_token_ids == (2, 3)


def test_qwen2_bias_and_inactive_window() -> None:
    config = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"],
                                    "sliding_window": 4096, "use_sliding_window": False})
    assert config.attention_bias is True
    assert config.sliding_window is None


def test_mistral_window() -> None:
    config = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"],
                                    "sliding_window": 128})
    assert config.sliding_window == 128
    assert ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"],
                                  "sliding_window": None}).sliding_window is None


def test_llama3_rope_scaling() -> None:
    config = ModelConfig.from_dict({**BASE, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)


def test_unknown_rope_scaling_is_refused() -> None:
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0}},
                              source="m/config.json")
    assert str(info.value) == ("m/config.json: rope_scaling type 'yarn' is not supported "
                               "(supported: llama3, longrope)")


def test_unsupported_architecture() -> None:
    with pytest.raises(UnsupportedModelError, match="'Qwen2MoeForCausalLM' is not supported"):
        ModelConfig.from_dict({**BASE, "architectures": ["Qwen2MoeForCausalLM"]})


def test_heads_must_divide() -> None:
    with pytest.raises(ValueError) as info:
        ModelConfig.from_dict({**BASE, "num_key_value_heads": 3})
    assert str(info.value) == ("num_attention_heads (4) must be a multiple of "
                               "num_key_value_heads (3)")


def test_missing_key() -> None:
    raw = dict(BASE)
    del raw["intermediate_size"]
    with pytest.raises(CheckpointError, match="config.json: required key 'intermediate_size'"):
        ModelConfig.from_dict(raw)


def test_eos_outside_vocab() -> None:
    with pytest.raises(ValueError, match=r"special token id 100 is outside the vocabulary \(vocab"):
        ModelConfig.from_dict({**BASE, "eos_token_id": [2, 100]})

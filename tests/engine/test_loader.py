"""engine.loader: every malformed checkpoint is refused with a message that
names the file, the tensor and the shapes; every supported variant loads."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError, UnsupportedModelError
from engine.loader import expected_tensors, load_model
from engine.make_model import make_model
from engine.model_config import ModelConfig
from engine.reference import reference_logits

PROMPT = [0, 11, 300, 7, 999, 42, 8]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_loads_every_parameter_exactly(tiny_model_dir: Path) -> None:
    model, config = load_model(tiny_model_dir, dtype="float32")
    raw = load_file(str(tiny_model_dir / "model.safetensors"))
    attn = model.model.layers[1].self_attn
    q, kv = config.q_size, config.kv_size
    assert torch.equal(attn.qkv_proj.weight[:q], raw["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(attn.qkv_proj.weight[q:q + kv],
                       raw["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(attn.qkv_proj.weight[q + kv:], raw["model.layers.1.self_attn.v_proj.weight"])
    mlp = model.model.layers[0].mlp
    inter = config.intermediate_size
    assert torch.equal(mlp.gate_up_proj.weight[:inter], raw["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(mlp.gate_up_proj.weight[inter:], raw["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, raw["lm_head.weight"])
    assert len(raw) == len(expected_tensors(config)) == 3 + 9 * config.num_hidden_layers


def test_missing_config(tmp_path: Path) -> None:
    expected = f"{tmp_path / 'config.json'}: file not found"
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        load_model(tmp_path)


def test_missing_weights_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError,
                       match=re.escape(f"{model_dir / 'model.safetensors'}: file not found")):
        load_model(model_dir)


def test_missing_tensor(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    _rewrite_weights(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError) as info:
        load_model(model_dir)
    assert str(info.value) == (
        f"{model_dir / 'model.safetensors'}: missing tensor 'model.layers.1.mlp.up_proj.weight'"
    )


def test_wrong_shape(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_weights(model_dir, lambda t: t.update({name: torch.zeros(64, 128)}))
    with pytest.raises(CheckpointError) as info:
        load_model(model_dir)
    assert str(info.value) == (
        f"{model_dir / 'model.safetensors'}: tensor '{name}' has shape (64, 128), "
        "expected (128, 128)"
    )


def test_unexpected_tensor(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    _rewrite_weights(model_dir, lambda t: t.update({"model.layers.5.mlp.up_proj.weight":
                                                     torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError) as info:
        load_model(model_dir)
    assert str(info.value) == (
        f"{model_dir / 'model.safetensors'}: unexpected tensor "
        "'model.layers.5.mlp.up_proj.weight' for LlamaForCausalLM"
    )


def test_rotary_inv_freq_is_a_harmless_extra(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    _rewrite_weights(model_dir, lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)}))
    model, _ = load_model(model_dir)
    reference = load_model(tiny_model_dir)[0]
    assert torch.equal(reference_logits(model, PROMPT), reference_logits(reference, PROMPT))


def test_unsupported_architecture(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        load_model(model_dir)
    assert str(info.value) == (
        "architecture 'GPT2LMHeadModel' is not supported (supported: LlamaForCausalLM, "
        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
        "MixtralForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM)"
    )


def test_sharded_checkpoint_loads_identically(tiny_model_dir: Path, tmp_path: Path) -> None:
    sharded_dir = make_model(tmp_path / "sharded", size="tiny", seed=0, num_shards=3)
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    sharded, _ = load_model(sharded_dir)
    single, _ = load_model(tiny_model_dir)
    single_params = dict(single.named_parameters())
    for name, param in sharded.named_parameters():
        assert torch.equal(param, single_params[name]), name


def test_sharded_checkpoint_missing_shard(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "sharded", num_shards=2)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError,
                       match=re.escape(f"{model_dir / 'model-00002-of-00002.safetensors'}: "
                                       "file not found (listed in")):
        load_model(model_dir)


def test_sharded_checkpoint_tensor_absent_from_its_shard(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "sharded", num_shards=2)
    shard = model_dir / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError,
                       match=re.escape(f"{shard}: missing tensor 'model.embed_tokens.weight'")):
        load_model(model_dir)


@pytest.mark.parametrize("variant, checks", [
    ({"architecture": "Qwen2ForCausalLM"}, {"attention_bias": True, "sliding_window": None}),
    ({"architecture": "MistralForCausalLM", "sliding_window": 4},
     {"attention_bias": False, "sliding_window": 4}),
    ({"tie_word_embeddings": True}, {"tie_word_embeddings": True}),
    ({"llama3_rope_scaling": True}, {"tie_word_embeddings": False}),
])
def test_variants_load_and_run(tmp_path: Path, variant: dict, checks: dict) -> None:
    model_dir = make_model(tmp_path / "m", **variant)
    model, config = load_model(model_dir)
    for key, value in checks.items():
        assert getattr(config, key) == value, key
    if config.attention_bias:
        assert model.model.layers[0].self_attn.qkv_proj.bias.shape == (config.q_size
                                                                       + 2 * config.kv_size,)
    logits = reference_logits(model, PROMPT)
    assert logits.shape == (len(PROMPT), config.vocab_size)
    assert torch.isfinite(logits).all()


def test_auto_dtype_follows_config(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "bf16", dtype="bfloat16")
    assert ModelConfig.from_pretrained(model_dir).torch_dtype == "bfloat16"
    assert load_model(model_dir)[0].dtype == torch.bfloat16
    assert load_model(model_dir, dtype=torch.float32)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load_model(model_dir, dtype="int8")

"""GGUF -> Hugging Face directory: weights, config, refusals.

The built-in tiny model (HF layout, random weights; Llama, Qwen2, Qwen3) is written as GGUF the
way llama.cpp's converter writes it (tests/engine/gguf/gguf_files.py) and
converted back: in F32 every tensor must come back bit for bit (names,
shapes, the q/k row order undone) and the engine's logits equal the
original's; quantized tensors must come back as the `gguf` package
dequantizes them. Broken files are refused before anything is written.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from engine.errors import CheckpointError, UnsupportedModelError
from engine.gguf.convert import convert_gguf
from engine.loader import load_model
from engine.make_model import make_model
from engine.reference import reference_logits
from tests.engine.gguf.gguf_files import gguf, gguf_name, write_gguf

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict, dict[str, np.ndarray]]:
    path = make_model(tmp_path_factory.mktemp("hf") / "tiny", size="tiny", seed=3)
    config = json.loads((path / "config.json").read_text())
    return path, config, load_file(str(path / "model.safetensors"))


def _converted(tmp_path: Path, gguf_path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    out = tmp_path / "converted"
    convert_gguf(gguf_path, out)
    return (json.loads((out / "config.json").read_text()),
            load_file(str(out / "model.safetensors")))


@pytest.fixture(scope="module", params=[("llama", "LlamaForCausalLM"),
                                        ("qwen2", "Qwen2ForCausalLM"),
                                        ("qwen3", "Qwen3ForCausalLM")], ids=lambda p: p[0])
def family(request, tmp_path_factory) -> tuple[str, Path, dict, dict[str, np.ndarray]]:
    """(GGUF architecture, the HF checkpoint, its config, its weights): Qwen2
    has q/k/v biases, Qwen3 q/k norms, neither llama.cpp's q/k row order."""
    arch, hf_architecture = request.param
    path = make_model(tmp_path_factory.mktemp("hf") / arch, size="tiny", seed=4,
                      architecture=hf_architecture)
    config = json.loads((path / "config.json").read_text())
    return arch, path, config, load_file(str(path / "model.safetensors"))


def test_f32_round_trip_is_exact_and_the_engine_agrees(family, tmp_path):
    arch, path, config, weights = family
    config_out, weights_out = _converted(tmp_path, write_gguf(tmp_path / "t.gguf", config,
                                                              weights, arch=arch))
    assert sorted(weights_out) == sorted(weights)
    for name, array in weights.items():
        assert np.array_equal(weights_out[name], array), name  # q/k rows back in place
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings"):
        assert config_out[key] == config[key], key
    assert config_out["architectures"] == config["architectures"]
    assert config_out["rope_theta"] == pytest.approx(config["rope_theta"])
    prompt = list(range(5, 45))
    ours, _ = load_model(tmp_path / "converted", dtype="float32")
    original, _ = load_model(path, dtype="float32")
    with torch.inference_mode():
        assert torch.equal(reference_logits(ours, prompt), reference_logits(original, prompt))


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_tensors_come_back_as_gguf_dequantizes_them(tiny, tmp_path, kind):
    _, config, weights = tiny
    quantized = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.embed_tokens.weight"]
    source = write_gguf(tmp_path / "q.gguf", config, weights, types=dict.fromkeys(quantized, kind))
    _, weights_out = _converted(tmp_path, source)
    qtype = gguf.GGMLQuantizationType[kind]
    for name in quantized:
        # quantization blocks run along a row, so reordering rows commutes with it
        expected = gguf.quants.dequantize(gguf.quants.quantize(weights[name], qtype), qtype)
        assert np.array_equal(weights_out[name], expected), name
        assert not np.array_equal(weights_out[name], weights[name])  # really quantized
    assert np.array_equal(weights_out["model.layers.0.self_attn.k_proj.weight"],
                          weights["model.layers.0.self_attn.k_proj.weight"])


def _k_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks with finite, small scales (the `gguf` package
    dequantizes K types but cannot quantize them)."""
    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scale = np.frombuffer(struct.pack("<e", 0.01), dtype=np.uint8)
    if kind == "Q6_K":
        blocks[..., 208:210] = scale  # d last
    else:
        blocks[..., 0:2] = scale  # d, dmin first
        blocks[..., 2:4] = scale
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_tensors(tmp_path, kind):
    config = dict(num_hidden_layers=1, max_position_embeddings=512, hidden_size=256,
                  intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=10000.0, rms_norm_eps=1e-5)
    from tests.engine.gguf.gguf_files import tiny_tokenizer_metadata

    vocab = len(tiny_tokenizer_metadata()["tokens"])
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, 256), "model.norm.weight": (256,),
              "lm_head.weight": (vocab, 256)}
    layer = {"input_layernorm.weight": (256,), "post_attention_layernorm.weight": (256,),
             "self_attn.q_proj.weight": (256, 256), "self_attn.k_proj.weight": (128, 256),
             "self_attn.v_proj.weight": (128, 256), "self_attn.o_proj.weight": (256, 256),
             "mlp.up_proj.weight": (512, 256)}
    shapes.update({f"model.layers.0.{k}": v for k, v in layer.items()})
    weights = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    gate = _k_blocks(kind, 512, 256, 1)
    down = _k_blocks(kind, 256, 512, 2)
    source = write_gguf(tmp_path / "k.gguf", config, weights, raw={
        "blk.0.ffn_gate.weight": (gate, kind), "blk.0.ffn_down.weight": (down, kind)})
    _, out = _converted(tmp_path, source)
    qtype = gguf.GGMLQuantizationType[kind]
    assert np.array_equal(out["model.layers.0.mlp.gate_proj.weight"],
                          gguf.quants.dequantize(gate, qtype))
    assert out["model.layers.0.mlp.down_proj.weight"].shape == (256, 512)
    assert np.isfinite(out["model.layers.0.mlp.down_proj.weight"]).all()


def _refused(tmp_path: Path, source: Path, error: type, *fragments: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(error) as info:
        convert_gguf(source, out)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert not out.exists()  # nothing half-written


def test_a_truncated_file_is_refused_by_name(tiny, tmp_path):
    _, config, weights = tiny
    source = write_gguf(tmp_path / "t.gguf", config, weights)
    data = source.read_bytes()
    source.write_bytes(data[: len(data) // 2])
    _refused(tmp_path, source, CheckpointError, str(source), "truncated")
    source.write_bytes(b"not a gguf file at all" * 10)
    _refused(tmp_path, source, CheckpointError, str(source), "not a readable GGUF file")


def test_an_unsupported_architecture_is_refused(tiny, tmp_path):
    _, config, weights = tiny
    source = write_gguf(tmp_path / "t.gguf", config, weights, arch="gptneox")
    _refused(tmp_path, source, UnsupportedModelError, str(source),
             "general.architecture 'gptneox' is not supported", "llama")


def test_an_unsupported_tensor_type_is_refused_naming_the_tensor(tiny, tmp_path):
    _, config, weights = tiny
    weights = dict(weights)
    down = weights.pop("model.layers.1.mlp.down_proj.weight")
    # well-formed Q8_1 blocks (a type the `gguf` package reads, this loader does not take)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    blocks = np.zeros((down.shape[0], down.shape[1] // block * size), dtype=np.uint8)
    source = write_gguf(tmp_path / "t.gguf", config, weights,
                        raw={"blk.1.ffn_down.weight": (blocks, "Q8_1")})
    _refused(tmp_path, source, UnsupportedModelError, str(source),
             "tensor blk.1.ffn_down.weight has type Q8_1", "supported: F32")


def test_missing_unexpected_and_misshapen_tensors_are_refused(tiny, tmp_path):
    _, config, weights = tiny
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    _refused(tmp_path, write_gguf(tmp_path / "a.gguf", config, missing), CheckpointError,
             "tensor blk.1.ffn_up.weight is missing")
    extra = write_gguf(tmp_path / "b.gguf", config, weights,
                       raw={"blk.0.ffn_extra.weight": (np.zeros((4, 4), np.float32), "F32")})
    _refused(tmp_path, extra, CheckpointError, "unexpected tensor blk.0.ffn_extra.weight")
    bad = dict(weights)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"][:-1]
    _refused(tmp_path, write_gguf(tmp_path / "c.gguf", config, bad), CheckpointError,
             f"tensor {gguf_name('model.layers.0.mlp.up_proj.weight')} has shape",
             "expected [256, 128]")


def test_a_missing_metadata_key_is_refused_by_name(tiny, tmp_path):
    _, config, weights = tiny
    source = write_gguf(tmp_path / "t.gguf", config, weights, skip_keys=("block_count",))
    _refused(tmp_path, source, CheckpointError, str(source),
             "metadata key llama.block_count is missing")

"""A GGUF file's model metadata as a Hugging Face `config.json`.

Called by `engine.gguf.convert`. GGUF keys are `<arch>.<name>` with the
architecture from `general.architecture`; the families here are those
whose GGUF layout is the plain Llama decoder under llama.cpp's standard
names (Mistral's GGUFs say `llama`). Anything else is refused by name
before a byte is written, rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import UnsupportedModelError
from engine.gguf.reader import GGUFFile


@dataclass(frozen=True, slots=True)
class Family:
    """What one GGUF `general.architecture` becomes in transformers' terms."""

    hf_architecture: str
    model_type: str
    # llama.cpp's converter reorders the rows of q and k for its RoPE
    # (interleaved pairs) in the `llama` family only; the loader undoes it.
    permuted_qk: bool
    attention_bias: bool = False
    qk_norm: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", permuted_qk=False, attention_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", permuted_qk=False, qk_norm=True),
}


def family_of(gguf: GGUFFile) -> tuple[str, Family]:
    arch = gguf.get("general.architecture", str, required=True)
    if arch not in FAMILIES:
        raise UnsupportedModelError(
            f"{gguf.path}: general.architecture {arch!r} is not supported for GGUF "
            f"(supported: {', '.join(FAMILIES)}); convert the original checkpoint instead")
    return arch, FAMILIES[arch]


def hf_config(gguf: GGUFFile, vocab_size: int, bos_token_id: int | None,
              eos_token_id: int | None) -> dict[str, Any]:
    """config.json for `gguf` (float32: the weights are dequantized to it).
    `vocab_size` counts the tokenizer's tokens, used when the model does
    not state its own."""
    arch, family = family_of(gguf)
    scaling = gguf.get(f"{arch}.rope.scaling.type", str, "none")
    if scaling != "none":
        raise UnsupportedModelError(f"{gguf.path}: {arch}.rope.scaling.type {scaling!r} is "
                                    "not supported for GGUF (supported: none)")
    if "rope_freqs.weight" in {t.name for t in gguf.reader.tensors}:
        raise UnsupportedModelError(
            f"{gguf.path}: tensor rope_freqs.weight (Llama 3.1 RoPE frequency factors) is "
            "not supported for GGUF; convert the original checkpoint instead")
    hidden = gguf.positive(f"{arch}.embedding_length")
    heads = gguf.positive(f"{arch}.attention.head_count")
    if isinstance(gguf.metadata.get(f"{arch}.attention.head_count_kv"), list):
        raise UnsupportedModelError(f"{gguf.path}: {arch}.attention.head_count_kv differs "
                                    "per layer; only one KV head count is supported")
    kv_heads = gguf.positive(f"{arch}.attention.head_count_kv", heads)
    head_dim = gguf.positive(f"{arch}.attention.key_length", hidden // heads)
    value_dim = gguf.positive(f"{arch}.attention.value_length", head_dim)
    rope_dim = gguf.positive(f"{arch}.rope.dimension_count", head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise UnsupportedModelError(
            f"{gguf.path}: key_length {head_dim}, value_length {value_dim} and "
            f"rope.dimension_count {rope_dim} must be equal (partial or asymmetric heads are "
            "not supported for GGUF)")
    tensors = {t.name for t in gguf.reader.tensors}
    config: dict[str, Any] = {
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
        "vocab_size": gguf.positive(f"{arch}.vocab_size", vocab_size),
        "hidden_size": hidden,
        "intermediate_size": gguf.positive(f"{arch}.feed_forward_length"),
        "num_hidden_layers": gguf.positive(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon",
                                       float, required=True)),
        "rope_theta": float(gguf.get(f"{arch}.rope.freq_base", (float, int), 10000.0)),
        "max_position_embeddings": gguf.positive(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    if family.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    window = gguf.get(f"{arch}.attention.sliding_window", int)
    if window:
        raise UnsupportedModelError(f"{gguf.path}: {arch}.attention.sliding_window {window} "
                                    "is not supported for GGUF (full attention only)")
    return config

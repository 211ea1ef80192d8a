"""A GGUF file's tensors as Hugging Face-named float32 arrays.

Called by `engine.gguf.convert`. Three rules:

* Dequantization is the `gguf` package's (`gguf.quants.dequantize`), for
  the types in `SUPPORTED_TYPES` only; a tensor of any other type is
  refused by name before anything is written.
* llama.cpp's converter stores the rows of each q and k head of `llama`
  models reordered for its RoPE (the two halves of a head interleaved:
  rows (0, h/2, 1, h/2+1, ...)). The engine, like transformers, rotates
  halves, so those rows are put back (`unpermute_rows`).
* Every tensor the model needs must be present with the shape its config
  implies, and nothing else may be: a file that converts is a file that
  matches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from engine.errors import CheckpointError, UnsupportedModelError
from engine.gguf.hf_config import Family
from engine.gguf.reader import GGUFFile

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q4_K", "Q5_K", "Q6_K")


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: within each head, rows
    (0, 1, ..., h-1) were stored as the pairs (0, h/2), (1, h/2 + 1), ...;
    give them back in halves. Works on weights and on biases (1-D)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    split = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(weight.shape))


def _layer_names(config: dict[str, Any], family: Family) -> list[tuple[str, str, tuple]]:
    """(GGUF name, HF name, shape) of one layer's tensors, `{i}` for the index."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    attn, mlp = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
    names = [
        ("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight", (hidden,)),
        ("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight",
         (hidden,)),
        ("blk.{i}.attn_q.weight", f"{attn}.q_proj.weight", (q_rows, hidden)),
        ("blk.{i}.attn_k.weight", f"{attn}.k_proj.weight", (kv_rows, hidden)),
        ("blk.{i}.attn_v.weight", f"{attn}.v_proj.weight", (kv_rows, hidden)),
        ("blk.{i}.attn_output.weight", f"{attn}.o_proj.weight", (hidden, q_rows)),
        ("blk.{i}.ffn_gate.weight", f"{mlp}.gate_proj.weight", (inter, hidden)),
        ("blk.{i}.ffn_up.weight", f"{mlp}.up_proj.weight", (inter, hidden)),
        ("blk.{i}.ffn_down.weight", f"{mlp}.down_proj.weight", (hidden, inter)),
    ]
    if family.attention_bias or config.get("attention_bias"):
        names += [("blk.{i}.attn_q.bias", f"{attn}.q_proj.bias", (q_rows,)),
                  ("blk.{i}.attn_k.bias", f"{attn}.k_proj.bias", (kv_rows,)),
                  ("blk.{i}.attn_v.bias", f"{attn}.v_proj.bias", (kv_rows,))]
        if config.get("attention_bias"):  # Llama's flag covers o_proj too
            names.append(("blk.{i}.attn_output.bias", f"{attn}.o_proj.bias", (hidden,)))
    if family.qk_norm:
        names += [("blk.{i}.attn_q_norm.weight", f"{attn}.q_norm.weight", (head_dim,)),
                  ("blk.{i}.attn_k_norm.weight", f"{attn}.k_norm.weight", (head_dim,))]
    return names


def expected_tensors(config: dict[str, Any], family: Family) -> dict[str, tuple[str, tuple]]:
    """GGUF name -> (HF name, shape) for every tensor of `config`'s model."""
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    expected = {
        "token_embd.weight": ("model.embed_tokens.weight", (vocab, hidden)),
        "output_norm.weight": ("model.norm.weight", (hidden,)),
    }
    if not config["tie_word_embeddings"]:
        expected["output.weight"] = ("lm_head.weight", (vocab, hidden))
    per_layer = _layer_names(config, family)
    for i in range(config["num_hidden_layers"]):
        for gguf_name, hf_name, shape in per_layer:
            expected[gguf_name.format(i=i)] = (hf_name.format(i=i), shape)
    return expected


def check_tensors(gguf: GGUFFile, config: dict[str, Any], family: Family) -> None:
    """Names, types and shapes of every tensor, before any is dequantized."""
    expected = expected_tensors(config, family)
    present = {t.name: t for t in gguf.reader.tensors}
    missing = [name for name in expected if name not in present]
    if missing:
        raise CheckpointError(f"{gguf.path}: tensor {missing[0]} is missing"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, tensor in present.items():
        if name not in expected:
            raise CheckpointError(f"{gguf.path}: unexpected tensor {name} for a "
                                  f"{config['architectures'][0]} of this config")
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{gguf.path}: tensor {name} has type {kind}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_TYPES)})")
        # GGUF lists dimensions innermost first
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        want = expected[name][1]
        if shape != want:
            raise CheckpointError(f"{gguf.path}: tensor {name} has shape {list(shape)}, "
                                  f"expected {list(want)} from the metadata")


def hf_tensors(gguf: GGUFFile, config: dict[str, Any], family: Family
               ) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for each tensor, dequantized one at a time
    (peak memory: the arrays kept by the caller, plus one). Call
    `check_tensors` first."""
    from gguf import quants

    expected = expected_tensors(config, family)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in gguf.reader.tensors:
        hf_name, shape = expected[tensor.name]
        try:
            array = quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:  # a short read of a truncated memmap, a bad block
            raise CheckpointError(f"{gguf.path}: tensor {tensor.name} "
                                  f"({tensor.tensor_type.name}) cannot be read: {exc}") from None
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if family.permuted_qk and kind in heads:
            array = unpermute_rows(array, heads[kind])
        yield hf_name, array

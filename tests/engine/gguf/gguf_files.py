"""Small GGUF files written for tests with the `gguf` package's writer.

`write_gguf` stores a Hugging Face-layout model (name -> float32 array) the
way llama.cpp's converter does: GGUF tensor names, the q and k rows of
`llama` models reordered for llama.cpp's RoPE (`to_llama_cpp_rows`, written
here from llama.cpp's documented layout, independently of the loader's
inverse), each tensor in the type the caller asks for. The tokenizer is the
built-in tiny model's byte-level BPE as GGUF metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{LAYER_HF_TO_GGUF[rest]}"


def to_llama_cpp_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Row r = (half h, index i) of each head goes to position 2 i + h: the
    two halves of a head interleaved, as llama.cpp stores q and k."""
    head = weight.shape[0] // num_heads
    out = np.empty_like(weight)
    for start in range(0, weight.shape[0], head):
        for i in range(head // 2):
            out[start + 2 * i] = weight[start + i]
            out[start + 2 * i + 1] = weight[start + head // 2 + i]
    return out


def tiny_tokenizer_metadata() -> dict[str, Any]:
    """The built-in tiny model's tokenizer (byte-level BPE, Llama 3 style
    split) as GGUF tokenizer keys."""
    from engine.make_model import SPECIAL_TOKENS, build_tokenizer

    data = json.loads(build_tokenizer().to_str())
    vocab = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {
        "tokens": tokens,
        "token_type": [3 if t in SPECIAL_TOKENS else 1 for t in tokens],
        "merges": merges,
        "bos": tokens.index(SPECIAL_TOKENS[0]),
        "eos": tokens.index(SPECIAL_TOKENS[1]),
    }


def write_gguf(path: Path, config: dict[str, Any], weights: dict[str, np.ndarray], *,
               arch: str = "llama", types: dict[str, str] | None = None,
               raw: dict[str, tuple[np.ndarray, str]] | None = None,
               skip_keys: tuple[str, ...] = ()) -> Path:
    """A GGUF file of `weights` (HF names) for HF `config`; `types` gives a
    tensor's GGML type by HF name (default F32); `raw` adds tensors by GGUF
    name as (bytes per row, type) without conversion."""
    tok = tiny_tokenizer_metadata()
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    keys = {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
    }
    for key, value in keys.items():
        if key not in skip_keys:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", config["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    if config.get("head_dim") and config["head_dim"] != config["hidden_size"] // heads:
        writer.add_uint32(f"{arch}.attention.key_length", config["head_dim"])
        writer.add_uint32(f"{arch}.attention.value_length", config["head_dim"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["token_type"])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(tok["bos"])
    writer.add_eos_token_id(tok["eos"])
    writer.add_add_bos_token(True)
    for hf_name, array in weights.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            array = to_llama_cpp_rows(array, heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            array = to_llama_cpp_rows(array, kv_heads)
        kind = gguf.GGMLQuantizationType[(types or {}).get(hf_name, "F32")]
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(hf_name), array)
        else:
            writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(array, kind),
                              raw_dtype=kind)
    for name, (data, kind) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""`convert_gguf`: a GGUF file into a Hugging Face model directory.

Called by `pdserve make-model --from-gguf FILE DIR` and, through
`engine.model_source`, by every role given a `.gguf` file or a named GGUF
model (converted once into the model cache). The directory holds
`config.json`, float32 safetensors (`model.safetensors`, or shards of at
most `SHARD_BYTES` with `model.safetensors.index.json`), `tokenizer.json`,
`tokenizer_config.json` (with the chat template) and
`generation_config.json`: what the engine's loader, transformers and vLLM
read unchanged, so a peer can serve the very same weights.

Why convert rather than load GGUF in the engine: one loading path (the
safetensors loader and its shape checks) for every format, the router
reads only tokenizer files, and the dequantization (seconds) happens once
per machine, not at every pod start. float32 because that is what the
`gguf` package dequantizes to: storing it rounded would change the model.

Everything is checked (metadata, every tensor's name, type and shape, the
tokenizer) before the first byte is written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.gguf.hf_config import family_of, hf_config
from engine.gguf.reader import open_gguf
from engine.gguf.tokenizer import build_tokenizer
from engine.gguf.weights import check_tensors, hf_tensors

SHARD_BYTES = 4 << 30


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_weights(out: Path, tensors, save_file) -> None:
    """Save `tensors` ((name, array) pairs, in order) into shards of at most
    SHARD_BYTES; one file needs no index."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors:
        if shards[-1] and size + array.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(a.nbytes for shard in shards for a in shard.values())
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> float:
    """Write the HF directory for `gguf_path` into `out_dir` (created; must be
    new or empty). Returns the seconds it took. CheckpointError (or its
    UnsupportedModelError) for a file that cannot be served, raised before
    `out_dir` is touched."""
    from safetensors.numpy import save_file

    started = time.monotonic()
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; the GGUF is converted into a new or empty "
                         "directory")
    gguf = open_gguf(gguf_path)
    _, family = family_of(gguf)
    tokenizer = build_tokenizer(gguf.metadata, str(gguf.path))
    hf_tok = tokenizer.tokenizer
    bos, eos = (None if text is None else hf_tok.token_to_id(text)
                for text in (tokenizer.bos_token, tokenizer.eos_token))
    config = hf_config(gguf, hf_tok.get_vocab_size(with_added_tokens=True), bos, eos)
    check_tensors(gguf, config, family)
    weights = list(hf_tensors(gguf, config, family))  # every tensor read before writing
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(out, weights, save_file)
    _write_json(out / "config.json", config)
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json",
                tokenizer.tokenizer_config(config["max_position_embeddings"]))
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "do_sample": False,
    })
    return time.monotonic() - started

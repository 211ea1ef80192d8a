"""Load a Hugging Face checkpoint of a supported architecture (safetensors
only, no pickle): Llama, Mistral, Qwen2/3, Phi-3, Mixtral.

Called once at pod start-up by the engine (on the thread that builds it),
and by tests and tools. A model directory holds `config.json` and either
`model.safetensors` or `model.safetensors.index.json` whose `weight_map`
names the shard of each tensor.

Every tensor the architecture needs must be present with exactly the
expected shape, and nothing unexpected may be present (besides known
harmless extras): a checkpoint that loads is a checkpoint that matches.

Under tensor parallelism (`tp`) each rank builds only its shard of the
model and reads only its slice of each tensor (`ShardLayout.selection`,
through safetensors' lazy slices): a model too large for one device never
has to fit on one. The checks above still compare the full shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import CheckpointError
from engine.layers.rotary import partial_rotary_order
from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.models.classes import model_class
from engine.parallel.group import TPGroup
from engine.parallel.shard import Selection, ShardLayout, Split
from kernels.dispatch import Backend

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class TensorTarget:
    """Where checkpoint tensor `hf_name` goes: rows [row_start, row_start +
    shape[0]) of model parameter `param_name` (merged projections), its rows
    taken in `row_order` when given (partial rotary's q/k head dims); under
    tensor parallelism a rank reads the part `split` gives it."""

    hf_name: str
    shape: tuple[int, ...]
    param_name: str
    row_start: int = 0
    row_order: tuple[int, ...] | None = None
    split: Split = Split.REPLICATED


def expected_tensors(config: ModelConfig) -> dict[str, TensorTarget]:
    """Every tensor a checkpoint of `config` must contain, by HF name."""
    hidden = config.hidden_size
    targets = [
        TensorTarget("model.embed_tokens.weight", (config.vocab_size, hidden),
                     "model.embed_tokens.weight", split=Split.VOCAB),
        TensorTarget("model.norm.weight", (hidden,), "model.norm.weight"),
    ]
    if not config.tie_word_embeddings:
        targets.append(TensorTarget("lm_head.weight", (config.vocab_size, hidden),
                                    "lm_head.weight", split=Split.VOCAB))
    for i in range(config.num_hidden_layers):
        hf = f"model.layers.{i}"
        targets += _attention_tensors(config, f"{hf}.self_attn")
        if config.num_local_experts:
            targets += _moe_tensors(config, hf)
        else:
            targets += _mlp_tensors(config, f"{hf}.mlp", f"{hf}.mlp")
        targets += [
            TensorTarget(f"{hf}.input_layernorm.weight", (hidden,),
                         f"{hf}.input_layernorm.weight"),
            TensorTarget(f"{hf}.post_attention_layernorm.weight", (hidden,),
                         f"{hf}.post_attention_layernorm.weight"),
        ]
        if config.gemma is not None:
            targets += [TensorTarget(name, shape, name) for name, shape
                        in config.gemma.norm_tensors(hf, hidden, config.head_dim)]
    return {t.hf_name: t for t in targets}


def _attention_tensors(config: ModelConfig, attn: str) -> list[TensorTarget]:
    """q/k/v (separate, or Phi-3's fused `qkv_proj`), o, biases, q/k norms."""
    hidden, q, kv = config.hidden_size, config.q_size, config.kv_size
    qkv = f"{attn}.qkv_proj.weight"
    if config.architecture == "Phi3ForCausalLM":
        order = None
        if config.rotary_dim != config.head_dim:
            dims = partial_rotary_order(config.head_dim, config.rotary_dim)
            heads = config.num_attention_heads + config.num_key_value_heads
            order = tuple(h * config.head_dim + d for h in range(heads) for d in dims)
            order += tuple(range(q + kv, q + 2 * kv))  # v as it is
        targets = [TensorTarget(qkv, (q + 2 * kv, hidden), qkv, 0, order, Split.QKV_HEADS)]
    else:
        targets = [
            TensorTarget(f"{attn}.q_proj.weight", (q, hidden), qkv, 0, split=Split.Q_HEADS),
            TensorTarget(f"{attn}.k_proj.weight", (kv, hidden), qkv, q, split=Split.KV_HEADS),
            TensorTarget(f"{attn}.v_proj.weight", (kv, hidden), qkv, q + kv,
                         split=Split.KV_HEADS),
        ]
    targets.append(TensorTarget(f"{attn}.o_proj.weight", (hidden, q), f"{attn}.o_proj.weight",
                                split=Split.Q_COLUMNS))
    if config.attention_bias:
        bias = f"{attn}.qkv_proj.bias"
        targets += [
            TensorTarget(f"{attn}.q_proj.bias", (q,), bias, 0, split=Split.Q_HEADS),
            TensorTarget(f"{attn}.k_proj.bias", (kv,), bias, q, split=Split.KV_HEADS),
            TensorTarget(f"{attn}.v_proj.bias", (kv,), bias, q + kv, split=Split.KV_HEADS),
        ]
    if config.qk_norm:
        targets += [TensorTarget(f"{attn}.{n}.weight", (config.head_dim,), f"{attn}.{n}.weight")
                    for n in ("q_norm", "k_norm")]
    return targets


def _mlp_tensors(config: ModelConfig, hf: str, param: str,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 ) -> list[TensorTarget]:
    """SwiGLU's gate/up (or Phi-3's fused `gate_up_proj`) and down, under HF
    prefix `hf` with those `names`, into `{param}.gate_up_proj` / `.down_proj`."""
    hidden, inter = config.hidden_size, config.intermediate_size
    gate_up, down = f"{param}.gate_up_proj.weight", f"{param}.down_proj.weight"
    if config.architecture == "Phi3ForCausalLM":
        targets = [TensorTarget(f"{hf}.gate_up_proj.weight", (2 * inter, hidden), gate_up,
                                split=Split.GATE_UP)]
    else:
        targets = [
            TensorTarget(f"{hf}.{names[0]}.weight", (inter, hidden), gate_up, 0,
                         split=Split.INTERMEDIATE),
            TensorTarget(f"{hf}.{names[1]}.weight", (inter, hidden), gate_up, inter,
                         split=Split.INTERMEDIATE),
        ]
    return targets + [TensorTarget(f"{hf}.{names[2]}.weight", (hidden, inter), down,
                                   split=Split.INTERMEDIATE_COLUMNS)]


def _moe_tensors(config: ModelConfig, layer: str) -> list[TensorTarget]:
    """Mixtral's `block_sparse_moe`: router `gate` and experts w1 (gate),
    w3 (up), w2 (down) into `mlp.router` / `mlp.experts.{e}` (engine/layers/moe.py)."""
    moe = f"{layer}.block_sparse_moe"
    targets = [TensorTarget(f"{moe}.gate.weight", (config.num_local_experts, config.hidden_size),
                            f"{layer}.mlp.router.weight")]
    for e in range(config.num_local_experts):
        targets += _mlp_tensors(config, f"{moe}.experts.{e}", f"{layer}.mlp.experts.{e}",
                                names=("w1", "w3", "w2"))
    return targets


def _is_harmless_extra(name: str, config: ModelConfig) -> bool:
    # Older exports save RoPE's inv_freq buffer (we rebuild it from the
    # config); tied checkpoints sometimes still carry lm_head.weight, which
    # HF ignores in favour of the embeddings, and so do we.
    if name.endswith(".self_attn.rotary_emb.inv_freq"):
        return True
    return config.tie_word_embeddings and name == "lm_head.weight"


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from the index or the single file."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: unreadable weight_map ({exc!r})") from None
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for name, path in files.items():
            if not path.is_file():
                raise CheckpointError(
                    f"{path}: file not found (listed in {index_path} for tensor {name!r})"
                )
        return files
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(
            f"{single}: file not found (a model directory needs {SINGLE_FILE} or {INDEX_FILE})"
        )
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """`"auto"` is the checkpoint's own dtype (config `torch_dtype`)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported (supported: {', '.join(DTYPES)})")
        return dtype
    name = config.torch_dtype if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    kernel_backend: Backend | str = Backend.AUTO,
    tp: TPGroup | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model described by `model_dir/config.json` and fill every
    parameter from the checkpoint. Raises CheckpointError (naming file,
    tensor and shapes) for any mismatch, UnsupportedModelError for an
    architecture or feature the engine cannot run (or, under `tp`, cannot
    split across its ranks). Returns the model (under `tp` this rank's
    shard, `model.shard`) and the full model's config."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    files = checkpoint_files(model_dir)
    expected = expected_tensors(config)
    for name, path in sorted(files.items()):
        if name not in expected and not _is_harmless_extra(name, config):
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for {config.architecture}")
    for name in expected:
        if name not in files:
            where = model_dir / (INDEX_FILE if (model_dir / INDEX_FILE).is_file() else SINGLE_FILE)
            raise CheckpointError(f"{where}: missing tensor {name!r}")

    model = model_class(config)(config, dtype=torch_dtype, device=device,
                                kernel_backend=kernel_backend, tp=tp)
    layout: ShardLayout = model.shard
    # Where each tensor lands in this rank's parameters (the same names).
    local = expected if tp is None else expected_tensors(layout.local_config(config))
    params = dict(model.named_parameters(remove_duplicate=False))
    by_file: dict[Path, list[TensorTarget]] = {}
    for name, target in expected.items():
        by_file.setdefault(files[name], []).append(target)
    for path, targets in by_file.items():
        with safe_open(path, framework="pt") as f:
            for target in targets:
                tensor = _read_tensor(f, path, target, layout.selection(target.split, config))
                _copy_tensor(tensor, local[target.hf_name], params[target.param_name])
    return model.train(False), config  # inference mode for every submodule


def _read_tensor(handle, path: Path, target: TensorTarget,
                 selection: Selection | None) -> torch.Tensor:
    """The tensor (its `selection` only, when given) after checking its full shape."""
    try:
        if selection is None:
            tensor = handle.get_tensor(target.hf_name)
            shape = tuple(tensor.shape)
        else:
            lazy = handle.get_slice(target.hf_name)
            shape = tuple(lazy.get_shape())
    except Exception as exc:  # safetensors raises its own error type for a missing name
        raise CheckpointError(f"{path}: missing tensor {target.hf_name!r} ({exc})") from None
    if shape != target.shape:
        raise CheckpointError(
            f"{path}: tensor {target.hf_name!r} has shape {shape}, expected {target.shape}"
        )
    if selection is None:
        return tensor
    rows = selection.rows or ((0, shape[0]),)
    parts = [lazy[start:end] if selection.cols is None
             else lazy[start:end, selection.cols[0]:selection.cols[1]]
             for start, end in rows]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _copy_tensor(tensor: torch.Tensor, target: TensorTarget, param: torch.Tensor) -> None:
    """`tensor` (all of it, or this rank's slice) into its rows of `param`;
    `target` is the tensor's place in this rank's model. A vocabulary
    shard's rows past the vocabulary are zeroed (they pad every rank's
    shard to one width)."""
    if target.row_order is not None:
        tensor = tensor[list(target.row_order)]
    rows = slice(target.row_start, target.row_start + tensor.shape[0])
    with torch.no_grad():
        param[rows].copy_(tensor.to(param.dtype))
        if target.split is Split.VOCAB:
            param[rows.stop:].zero_()

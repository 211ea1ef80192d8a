"""Built-in random-weight checkpoints in Hugging Face format.

`make_model(out_dir, size=..., seed=...)` writes config.json,
model.safetensors (or shards + index), tokenizer.json, tokenizer_config.json
and generation_config.json; the result loads through `engine.loader` and
`engine.tokenizer` exactly like a downloaded model. Same arguments, same
bytes: the weights come from one seeded generator in a fixed tensor order,
the tokenizer is trained deterministically on a built-in corpus, and JSON is
written with sorted keys.

Callers: `pdserve make-model`, `pdserve up` (through `ensure_model`), and the
test fixtures. Runs on the caller's thread; touches only `out_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.chat_template import BUILTIN_CHAT_TEMPLATE
from engine.loader import INDEX_FILE, SINGLE_FILE, expected_tensors
from engine.model_cache import models_home
from engine.model_config import ModelConfig

# head_dim 64 everywhere (the kernels run 64, 96, 128 and 256): tiny and fast.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 max_position_embeddings=4096, rope_theta=10000.0),
    "base": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                 max_position_embeddings=8192, rope_theta=500000.0),
}
# config.json's model_type of each architecture make-model writes.
MODEL_TYPES: dict[str, str] = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "MixtralForCausalLM": "mixtral",
}
# Architectures whose sliding_window applies to every layer as written; Qwen
# needs use_sliding_window (and max_window_layers 0 for every layer).
_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Llama 3 style scaling, sized so tiny models exercise all three frequency
# bands (kept, blended, divided) within a few hundred positions.
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
}

# --- tokenizer -------------------------------------------------------------

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN, END_OF_TEXT_TOKEN, "<|start_header_id|>", "<|end_header_id|>", EOT_TOKEN,
    "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
)
TOKENIZER_VOCAB_SIZE = 1536
# GPT-4 / Llama 3 style pre-tokenization: contractions, words with one
# leading non-letter, up to 3 digits, punctuation runs, newlines, spaces.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The training text: plain English, chat turns and code, a little CJK and
# emoji so some merges hold partial UTF-8 characters. Changing it changes
# every built-in model's token ids.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a step.
Hello! How can I help you today? I would like to know more about the weather in the city.
Sure, here is a short answer: the server splits prefill and decode across separate machines.
What is the capital of France? The capital of France is Paris, a city on the river Seine.
Please write a poem about the sea. The sea is wide and blue, and the waves come and go.
Thank you very much for your help. You are welcome; let me know if there is anything else.
The model reads the prompt, computes the key and value cache, and then generates one token
at a time. Each new token depends on all the tokens before it, so the cache saves work.
Requests arrive at the router, which picks a prefill pod and a decode pod for each one.
When the first token is ready, the router sends it to the client at once, then streams the rest.
In the morning we walked to the market, bought bread, apples, cheese and fresh green tea.
She said that they had never seen such a bright light in the night sky before that day.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 100 128 256 512 1000 1024 2048 4096 2026 3.14
def generate(prompt: str, max_tokens: int = 16) -> list[int]:
    tokens = tokenizer.encode(prompt)
    for _ in range(max_tokens):
        logits = model(tokens)
        next_token = int(logits[-1].argmax())
        tokens.append(next_token)
        if next_token == eos_token_id:
            break
    return tokens
class Request:
    def __init__(self, request_id, prompt_token_ids, sampling_params):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids = []
import json, os, sys
with open("config.json") as f:
    config = json.load(f)
print(f"hidden_size={config['hidden_size']} layers={config['num_hidden_layers']}")
for (int i = 0; i < n; i++) { sum += a[i] * b[i]; } return sum;
if (x == null || y != 0) { throw new Error("bad input"); }
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name ORDER BY 2 DESC;
{"model": "pdserve", "messages": [{"role": "user", "content": "Hello"}], "stream": true}
system

You are a helpful assistant. Answer briefly and clearly.

user

Hello, who are you? Can you explain what a token is?

assistant

I am an assistant. A token is a short piece of text, often a word or part of a word.

你好，世界。今天天气很好。我们一起去公园吧。こんにちは、元気ですか。안녕하세요.
Emoji: 🙂 😀 🚀 ❤️ 👍 🎉 — naïve café déjà vu, Straße, Ελληνικά, русский язык.
"""


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE (Llama 3 style) trained on `_CORPUS`.

    Byte level means every UTF-8 string round-trips: bytes missing from the
    merges fall back to single-byte tokens. Training is deterministic (same
    corpus and settings, same merges and ids); special tokens take ids 0..6.
    A post-processor prepends BOS when special tokens are requested, as
    Llama 3's tokenizer.json does.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE, min_frequency=1, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # The whole text, so newline runs ("\n\n" after chat headers) are
    # learned too; repetition keeps frequent pairs ahead of one-off ones.
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What to generate. Variants exist so loader tests cover each feature."""

    size: str = "tiny"
    seed: int = 0
    architecture: str = "LlamaForCausalLM"
    attention_bias: bool = False  # Qwen2 always has q/k/v biases
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    llama3_rope_scaling: bool = False
    num_shards: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}, got {self.size!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.architecture not in MODEL_TYPES:
            raise ValueError(f"architecture must be one of {', '.join(MODEL_TYPES)}, "
                             f"got {self.architecture!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or None, got {self.sliding_window}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


def build_config(spec: ModelSpec, vocab: dict[str, int]) -> dict[str, Any]:
    """The HF config.json dict for `spec` and the tokenizer's vocabulary."""
    config: dict[str, Any] = dict(SIZES[spec.size])
    config.update(
        architectures=[spec.architecture],
        model_type=MODEL_TYPES[spec.architecture],
        vocab_size=len(vocab),
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=vocab[BOS_TOKEN],
        eos_token_id=[vocab[END_OF_TEXT_TOKEN], vocab[EOT_TOKEN]],
        torch_dtype=spec.dtype,
        rope_scaling=LLAMA3_ROPE_SCALING if spec.llama3_rope_scaling else None,
    )
    if spec.architecture in _QWEN:
        config["use_sliding_window"] = spec.sliding_window is not None
        config["sliding_window"] = spec.sliding_window
        config["max_window_layers"] = 0  # every layer slides (transformers' default is 28)
    elif spec.architecture in _WINDOWED:
        config["sliding_window"] = spec.sliding_window
    elif spec.sliding_window is not None:
        raise ValueError(f"sliding_window needs one of {', '.join(_WINDOWED + _QWEN)}")
    if spec.architecture == "LlamaForCausalLM":
        config["attention_bias"] = spec.attention_bias
    if spec.architecture == "MixtralForCausalLM":
        config.update(num_local_experts=4, num_experts_per_tok=2)
    return config


def _init_std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a tensor's random init.

    Chosen so activations stay O(1) through the layers and the logits are
    peaked (std ~2): greedy decoding of a random model then has clear
    winners, so comparisons between engines are not decided by rounding.
    """
    if name.endswith("norm.weight"):  # layer norms, the final norm, Qwen3's q/k norms
        return 1.0, 0.1  # near 1, but not exactly, so a dropped norm weight is caught
    if name.endswith(".bias"):
        return 0.0, 0.1
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    if name == "lm_head.weight":
        return 0.0, 2.0 / shape[1] ** 0.5
    return 0.0, shape[1] ** -0.5  # projections: unit gain on fan-in


def build_weights(spec: ModelSpec, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor, in HF names, from one generator seeded with
    `spec.seed` and consumed in the fixed order of `expected_tensors`."""
    generator = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    weights: dict[str, torch.Tensor] = {}
    for name, target in expected_tensors(config).items():
        mean, std = _init_std(name, target.shape)
        tensor = torch.randn(target.shape, generator=generator, dtype=torch.float32)
        weights[name] = (tensor * std + mean).to(dtype).contiguous()
    return weights


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def _write_weights(out_dir: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(weights, str(out_dir / SINGLE_FILE), metadata=metadata)
        return
    names = list(weights)
    if num_shards > len(names):
        raise ValueError(f"num_shards {num_shards} exceeds the tensor count {len(names)}")
    weight_map: dict[str, str] = {}
    per_shard = -(-len(names) // num_shards)  # ceil: the last shard may be smaller
    for shard in range(num_shards):
        shard_names = names[shard * per_shard:(shard + 1) * per_shard]
        filename = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in shard_names}, str(out_dir / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(shard_names, filename))
    total_size = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": total_size},
                                       "weight_map": weight_map})


def _tokenizer_config(vocab: dict[str, int], max_length: int) -> dict[str, Any]:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "chat_template": BUILTIN_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_tokenizer(out_dir: str | Path, tokenizer: Tokenizer, max_length: int) -> None:
    """Write `tokenizer` (`build_tokenizer()`) as tokenizer.json and
    tokenizer_config.json into `out_dir`; also used for checkpoints written
    by other tools (the tests' transformers models)."""
    out = Path(out_dir)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer.get_vocab(), max_length))


def make_model(out_dir: str | Path, *, size: str = "tiny", seed: int = 0,
               **variant: Any) -> Path:
    """Write a complete checkpoint into `out_dir` (created; must not contain
    files). `variant` takes the other `ModelSpec` fields. Returns the path."""
    spec = ModelSpec(size=size, seed=seed, **variant)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; make-model writes into a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    config_dict = build_config(spec, vocab)
    config = ModelConfig.from_dict(config_dict, source=str(out / "config.json"))
    _write_weights(out, build_weights(spec, config), spec.num_shards)
    _write_json(out / "config.json", config_dict)
    write_tokenizer(out, tokenizer, config.max_position_embeddings)
    _write_json(out / "generation_config.json", {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "do_sample": False,
    })
    return out


def default_model_dir(size: str = "tiny") -> Path:
    """Where `ensure_model` keeps built-in models: pdserve-<size> in the
    model cache (engine.model_cache.models_home)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    return models_home() / f"pdserve-{size}"


def ensure_model(size: str = "tiny") -> Path:
    """The built-in model of `size` (seed 0), generated on first use.

    Atomic: generated in a temporary sibling directory and renamed into
    place, so a concurrent caller or a crash never leaves a half-written
    model behind; if another process wins the race, its copy is used."""
    target = default_model_dir(size)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
    try:
        make_model(tmp, size=size, seed=0)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target

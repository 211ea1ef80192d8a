"""`ModelConfig`: the validated shape of a Llama-family model, parsed from a
Hugging Face `config.json`.

Who uses it: `engine.loader.load_model` (to build the module and check tensor
shapes), the KV cache sizing in the engine (layers, kv heads, head dim), and
the prefill/decode services for the transfer compatibility check. It is
immutable and built once per process, so any thread may read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError, UnsupportedModelError
from engine.model_variants import (
    PHI3_LONGROPE_ALIASES,
    RMS_NORM_EPS_DEFAULTS,
    ROPE_THETA_DEFAULTS,
    LongRopeScaling,
    architecture_fields,
    rope_parameters_of,
)
from engine.models.gemma_config import GEMMA_ARCHITECTURES, GemmaConfig

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    *GEMMA_ARCHITECTURES,
)
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
SUPPORTED_ROPE_SCALING: tuple[str, ...] = ("llama3", "longrope")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )

    @classmethod
    def from_hf(cls, raw: dict[str, Any] | None, source: str) -> RopeScaling | None:
        """Parse HF's `rope_scaling` entry; None/absent means no scaling."""
        if raw is None:
            return None
        rope_type = raw.get("rope_type", raw.get("type"))
        if rope_type == "default":
            return None
        if rope_type not in SUPPORTED_ROPE_SCALING:
            raise UnsupportedModelError(
                f"{source}: rope_scaling type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_SCALING)})"
            )
        try:
            return cls(
                factor=float(raw["factor"]),
                low_freq_factor=float(raw["low_freq_factor"]),
                high_freq_factor=float(raw["high_freq_factor"]),
                original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
            )
        except KeyError as exc:
            raise CheckpointError(f"{source}: rope_scaling is missing {exc.args[0]!r}") from None


def _rope_scaling(scaling: dict[str, Any] | None, raw: dict[str, Any], architecture: str,
                  source: str) -> RopeScaling | LongRopeScaling | None:
    """Llama 3 or LongRoPE scaling from `scaling` (None/default: none)."""
    if scaling is None:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "longrope" or (architecture == "Phi3ForCausalLM"
                                   and rope_type in PHI3_LONGROPE_ALIASES):
        return LongRopeScaling.from_hf(scaling, raw, architecture, source)
    return RopeScaling.from_hf(scaling, source)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and hyper-parameters of one decoder-only model.

    Invariants checked at construction: all sizes positive, query heads a
    multiple of kv heads (GQA), head_dim even (RoPE rotates pairs), token ids
    inside the vocabulary.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | LongRopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # Qwen3: RMSNorm over each q and k head (q_norm, k_norm) before RoPE.
    qk_norm: bool = False
    # Phi-3: RoPE rotates the first head_dim * factor dims of each head.
    partial_rotary_factor: float = 1.0
    # Mixtral: a sparse MoE block replaces the MLP (0 experts: dense MLP).
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    # Gemma 2/3 only (engine/models/gemma_config.py); its layers' sliding
    # windows live there, so `sliding_window` above stays None for Gemma.
    gemma: GemmaConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or None, got {self.sliding_window}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dims "
                f"{self.rotary_dim} of head_dim {self.head_dim}; it must be even and in "
                f"(0, head_dim]")
        if isinstance(self.rope_scaling, LongRopeScaling) and (
                2 * len(self.rope_scaling.short_factor) != self.rotary_dim):
            raise ValueError(
                f"rope_scaling short_factor/long_factor have {len(self.rope_scaling.short_factor)}"
                f" values; rotary dims {self.rotary_dim} need {self.rotary_dim // 2}")
        if self.num_local_experts and not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_local_experts={self.num_local_experts}], "
                f"got {self.num_experts_per_tok}")
        if self.torch_dtype not in SUPPORTED_DTYPES:
            raise UnsupportedModelError(
                f"torch_dtype {self.torch_dtype!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_DTYPES)})"
            )
        for token_id in (*self.eos_token_ids, self.bos_token_id):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"special token id {token_id} is outside the vocabulary "
                    f"(vocab_size {self.vocab_size})"
                )

    @property
    def q_size(self) -> int:
        """Width of the query projection output: heads x head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_key_value_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (head_dim unless partial)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def context_limit(self) -> tuple[int, str]:
        """(the longest context the engine runs this model at, what sets it):
        the default and the upper bound of the engine's max_model_len."""
        if isinstance(self.rope_scaling, LongRopeScaling):
            return (self.rope_scaling.original_max_position_embeddings,
                    "rope_scaling 'longrope' original_max_position_embeddings (beyond it "
                    "transformers switches every position to long_factor, cached keys "
                    "included, which a KV cache cannot follow)")
        return self.max_position_embeddings, "max_position_embeddings"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a parsed HF config dict; `source` names it in errors."""
        architectures = raw.get("architectures") or []
        if len(architectures) != 1:
            raise UnsupportedModelError(
                f"{source}: expected exactly one entry in 'architectures', got {architectures!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        architecture = architectures[0]
        gemma_arch = architecture in GEMMA_ARCHITECTURES
        # Gemma reads its own RoPE (per layer type): engine/models/gemma_config.py
        rope = {} if gemma_arch else rope_parameters_of(raw, source)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            kwargs = dict(
                architecture=architecture,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                # head_dim may be explicit (and differ from hidden/heads) or null
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps",
                                           RMS_NORM_EPS_DEFAULTS.get(architecture, 1e-6))),
                rope_theta=float(rope.get("rope_theta",
                                          ROPE_THETA_DEFAULTS.get(architecture, 10000.0))),
                max_position_embeddings=int(raw["max_position_embeddings"]),
            )
        except KeyError as exc:
            raise CheckpointError(f"{source}: required key {exc.args[0]!r} is missing") from None
        # Qwen2 always has q/k/v biases; Llama exposes them through attention_bias.
        attention_bias = (bool(raw.get("attention_bias", False))
                          or architecture == "Qwen2ForCausalLM")
        sliding_window = raw.get("sliding_window")  # Qwen2/3: see architecture_fields
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        gemma = None
        if gemma_arch:
            gemma = GemmaConfig.from_hf(raw, architecture, kwargs["num_hidden_layers"], source)
            # Gemma ties embeddings unless told otherwise; RoPE and windows are its own.
            raw = {**raw, "tie_word_embeddings": raw.get("tie_word_embeddings", True)}
            kwargs["rope_theta"] = gemma.rope_theta
            sliding_window = None
        kwargs.update(
            rope_scaling=_rope_scaling(rope.get("rope_scaling"), raw, architecture, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            sliding_window=None if sliding_window is None else int(sliding_window),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(t) for t in eos_ids),
            # transformers 5 writes "dtype"
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            gemma=gemma,
        )
        if not gemma_arch:  # Gemma's variants are checked by GemmaConfig.from_hf
            kwargs.update(architecture_fields(architecture, raw, source))
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read `<model_dir>/config.json`; CheckpointError if absent or unreadable."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found (a model directory needs config.json)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot parse JSON: {exc}") from None
        return cls.from_dict(raw, source=str(path))

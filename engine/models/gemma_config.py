"""`GemmaConfig`: what Gemma 2 and Gemma 3 (text) add to a `ModelConfig`.

Parsed from the same Hugging Face `config.json` by `ModelConfig.from_dict`
(which keeps it in `ModelConfig.gemma`), read by `engine.models.gemma` to
build the module, by `engine.loader` for the extra norm tensors, and by
`engine.layer_attention` for each layer's attention (scale, sliding window,
soft-cap). Immutable; any thread may read it.

Both config spellings are accepted: the one the released checkpoints carry
(`rope_theta`, `rope_local_base_freq`, `sliding_window_pattern`) and the one
transformers 5 writes (`rope_parameters`, per layer type for Gemma 3, and
`layer_types`). Every variant the engine does not run is refused here, by
the name of the config field and its value, at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import UnsupportedModelError
from kernels.checks import HEAD_DIMS

GEMMA2 = "Gemma2ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
GEMMA_ARCHITECTURES: tuple[str, ...] = (GEMMA2, GEMMA3)
SLIDING, FULL = "sliding_attention", "full_attention"
# gelu with the tanh approximation, under the names transformers gives it.
GELU_TANH = ("gelu_pytorch_tanh",)
# Hugging Face's defaults where a config leaves a field out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    GEMMA2: dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                 sliding_window=4096, rope_theta=10000.0, rope_local_theta=10000.0),
    GEMMA3: dict(attn_logit_softcapping=None, final_logit_softcapping=None,
                 sliding_window=4096, rope_theta=1_000_000.0, rope_local_theta=10000.0),
}


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """Gemma's per-model extras. `layer_types[i]` is "sliding_attention"
    (attends to the last `sliding_window` positions, RoPE base
    `rope_local_theta`) or "full_attention" (RoPE base `rope_theta`);
    Gemma 2 uses one base for both."""

    architecture: str
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_theta: float
    rope_local_theta: float

    def __post_init__(self) -> None:
        if self.architecture not in GEMMA_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not a Gemma architecture")
        if not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or null, got {value}")
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {self.sliding_window}")
        for i, kind in enumerate(self.layer_types):
            if kind not in (SLIDING, FULL):
                raise UnsupportedModelError(
                    f"layer_types[{i}] {kind!r} is not supported (supported: {SLIDING}, {FULL})")
        if not (self.rope_theta > 0 and self.rope_local_theta > 0):
            raise ValueError(f"rope thetas must be > 0, got {self.rope_theta} and "
                             f"{self.rope_local_theta}")

    @property
    def qk_norm(self) -> bool:
        """Gemma 3 RMS-normalises each query and key head before RoPE."""
        return self.architecture == GEMMA3

    @property
    def attention_scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5

    def is_sliding(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == SLIDING

    def norm_tensors(self, layer: str, hidden: int,
                     head_dim: int) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of the norm weights a Llama checkpoint lacks, for
        the layer whose tensors start with `layer` ("model.layers.3")."""
        names = [(f"{layer}.pre_feedforward_layernorm.weight", (hidden,)),
                 (f"{layer}.post_feedforward_layernorm.weight", (hidden,))]
        if self.qk_norm:
            names += [(f"{layer}.self_attn.q_norm.weight", (head_dim,)),
                      (f"{layer}.self_attn.k_norm.weight", (head_dim,))]
        return names

    @classmethod
    def from_hf(cls, raw: dict[str, Any], architecture: str, num_layers: int,
                source: str) -> GemmaConfig:
        """Parse (and refuse what the engine does not run) from a config dict."""
        defaults = _DEFAULTS[architecture]
        activation = raw.get("hidden_activation") or raw.get("hidden_act")
        if activation not in GELU_TANH:
            raise UnsupportedModelError(
                f"{source}: hidden_activation {activation!r} is not supported "
                f"(supported: {', '.join(GELU_TANH)})")
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        if head_dim not in HEAD_DIMS:
            # Refused here rather than at the first forward pass (the released
            # checkpoints have 256 (Gemma 2 2B/9B, Gemma 3 1B) or 128 (Gemma 2
            # 27B), both run).
            raise UnsupportedModelError(
                f"{source}: head_dim {head_dim} is not supported by the attention kernels "
                f"(supported: {', '.join(map(str, HEAD_DIMS))})")
        if raw.get("attention_bias"):
            raise UnsupportedModelError(f"{source}: attention_bias true is not supported "
                                        "for Gemma")
        if raw.get("use_bidirectional_attention"):
            raise UnsupportedModelError(f"{source}: use_bidirectional_attention true "
                                        "(bidirectional Gemma encoders) is not supported")
        attn_cap = raw.get("attn_logit_softcapping", defaults["attn_logit_softcapping"])
        if architecture == GEMMA3 and attn_cap is not None:
            # transformers' Gemma 3 keeps the field but never applies it.
            raise UnsupportedModelError(
                f"{source}: attn_logit_softcapping {attn_cap!r} is not supported for Gemma 3 "
                "(Hugging Face's Gemma 3 ignores it; expected null)")
        final_cap = raw.get("final_logit_softcapping", defaults["final_logit_softcapping"])
        rope_theta, local_theta = _rope_thetas(raw, architecture, source)
        return cls(
            architecture=architecture,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
            final_logit_softcapping=None if final_cap is None else float(final_cap),
            sliding_window=int(raw.get("sliding_window") or defaults["sliding_window"]),
            layer_types=_layer_types(raw, architecture, num_layers, source),
            rope_theta=rope_theta,
            rope_local_theta=local_theta,
        )


def _layer_types(raw: dict[str, Any], architecture: str, num_layers: int,
                 source: str) -> tuple[str, ...]:
    explicit = raw.get("layer_types")
    if explicit is not None:
        if len(explicit) != num_layers:
            raise ValueError(f"{source}: layer_types has {len(explicit)} entries for "
                             f"num_hidden_layers {num_layers}")
        return tuple(explicit)
    if architecture == GEMMA2:  # sliding first, then alternating
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))
    pattern = int(raw.get("sliding_window_pattern") or 6)  # every pattern-th layer is global
    if pattern <= 0:
        raise ValueError(f"{source}: sliding_window_pattern must be > 0, got {pattern}")
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def _rope_thetas(raw: dict[str, Any], architecture: str, source: str) -> tuple[float, float]:
    """(full-attention theta, sliding-attention theta); only plain RoPE runs."""
    defaults = _DEFAULTS[architecture]
    if raw.get("rope_scaling") is not None:
        raise UnsupportedModelError(f"{source}: rope_scaling {raw['rope_scaling']!r} is not "
                                    "supported for Gemma (supported: none)")
    params = raw.get("rope_parameters")
    if params is None:  # the released checkpoints' spelling
        theta = float(raw.get("rope_theta", defaults["rope_theta"]))
        local = raw.get("rope_local_base_freq")
        if architecture == GEMMA2:
            return theta, theta
        return theta, float(local if local is not None else defaults["rope_local_theta"])
    per_type = params if FULL in params or SLIDING in params else {FULL: params, SLIDING: params}
    thetas = []
    for kind, default in ((FULL, defaults["rope_theta"]), (SLIDING, defaults["rope_local_theta"])):
        entry = per_type.get(kind) or {}
        rope_type = entry.get("rope_type", "default")
        if rope_type != "default":
            raise UnsupportedModelError(
                f"{source}: rope_parameters {kind} rope_type {rope_type!r} is not supported "
                "for Gemma (supported: default)")
        thetas.append(float(entry.get("rope_theta", default)))
    full, sliding = thetas
    return (full, full) if architecture == GEMMA2 else (full, sliding)

"""The architecture-dependent parts of reading a Hugging Face `config.json`.

Called only by `ModelConfig.from_dict` (engine/model_config.py), on whatever
thread builds the config; pure functions of the parsed JSON. What lives here:

- where RoPE's parameters are: top level (`rope_theta`, `rope_scaling`,
  `partial_rotary_factor`, the layout of hub checkpoints) or the
  `rope_parameters` dict that transformers 5 writes instead
  (`rope_parameters_of`);
- LongRoPE (`LongRopeScaling`, Phi-3's `rope_scaling` type `longrope`, older
  configs' `su`);
- the fields only some architectures have (`architecture_fields`: Qwen3's
  q/k norms, Phi-3's partial rotary, Mixtral's experts) and the variants of
  them the engine refuses: each refusal is an `UnsupportedModelError` (a
  ValueError) naming the config field and its value, never a silently
  different model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.errors import CheckpointError, UnsupportedModelError

# HF's defaults where a config may omit the field; the same for every other
# architecture the engine runs (rope_theta 10000, rms_norm_eps 1e-6).
ROPE_THETA_DEFAULTS: dict[str, float] = {"MixtralForCausalLM": 1e6}
RMS_NORM_EPS_DEFAULTS: dict[str, float] = {"Phi3ForCausalLM": 1e-5, "MixtralForCausalLM": 1e-5}
# Phi3Config's class default; transformers gives it priority over the value
# inside rope_scaling.
PHI3_ORIGINAL_MAX_POSITIONS = 4096
# Phi-3 configs name LongRoPE "su" (and transformers maps "yarn" to it for Phi-3).
PHI3_LONGROPE_ALIASES: tuple[str, ...] = ("longrope", "su", "yarn")


@dataclass(frozen=True, slots=True)
class LongRopeScaling:
    """LongRoPE (`rope_type: longrope`): per-frequency divisors and a
    cos/sin scale (`attention_factor`).

    transformers uses `short_factor` while the longest position of the
    forward pass is below `original_max_position_embeddings` and switches
    every position to `long_factor` beyond it, keys already cached included;
    a KV cache cannot follow that switch, so the engine runs these models up
    to `original_max_position_embeddings` tokens (`ModelConfig.context_limit`)
    with `short_factor`, where it matches transformers exactly.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    attention_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if len(self.short_factor) != len(self.long_factor) or not self.short_factor:
            raise ValueError(
                f"rope_scaling short_factor ({len(self.short_factor)} values) and long_factor "
                f"({len(self.long_factor)} values) must be non-empty and of equal length")
        if not all(f > 0 for f in self.short_factor + self.long_factor):
            raise ValueError("rope_scaling short_factor and long_factor must be > 0")
        if not self.attention_factor > 0:
            raise ValueError(f"rope_scaling attention_factor must be > 0, "
                             f"got {self.attention_factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("rope_scaling original_max_position_embeddings must be > 0, got "
                             f"{self.original_max_position_embeddings}")

    @classmethod
    def from_hf(cls, scaling: dict[str, Any], raw: dict[str, Any], architecture: str,
                source: str) -> LongRopeScaling:
        """From `rope_scaling` (or `rope_parameters`) and the whole config,
        with transformers' defaults: original_max_position_embeddings from the
        top level first (Phi-3: 4096 if absent), then from `scaling`, then
        max_position_embeddings; factor max/original; attention_factor
        sqrt(1 + ln(factor) / ln(original)) when factor > 1."""
        max_positions = int(raw["max_position_embeddings"])
        if "original_max_position_embeddings" in raw:
            original = int(raw["original_max_position_embeddings"])
        elif architecture == "Phi3ForCausalLM":
            original = PHI3_ORIGINAL_MAX_POSITIONS
        else:
            original = int(scaling.get("original_max_position_embeddings", max_positions))
        try:
            short = tuple(float(f) for f in scaling["short_factor"])
            long = tuple(float(f) for f in scaling["long_factor"])
        except KeyError as exc:
            raise CheckpointError(f"{source}: rope_scaling is missing {exc.args[0]!r}") from None
        factor = float(scaling.get("factor") or max_positions / original)
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = (1.0 if factor <= 1.0
                                else math.sqrt(1 + math.log(factor) / math.log(original)))
        return cls(short, long, float(attention_factor), original)


def rope_parameters_of(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """RoPE's settings wherever the config keeps them: `{"rope_theta",
    "rope_scaling" (dict or None), "partial_rotary_factor"}` (absent keys
    left out). Top-level keys win over `rope_parameters` (transformers 5's
    layout); a `rope_parameters` nested by layer type is refused."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: rope_parameters must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(
            f"{source}: rope_parameters per layer type ({', '.join(sorted(params))}) "
            "is not supported")
    out: dict[str, Any] = {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in raw:
            out[key] = raw[key]
        elif key in params:
            out[key] = params[key]
    scaling = raw.get("rope_scaling")
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    out["rope_scaling"] = scaling
    return out


def _refuse(source: str, field: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{source}: {field}={value!r} is not supported ({why})")


def _qwen_sliding_window(raw: dict[str, Any], source: str) -> int | None:
    """Qwen2/Qwen3's window as transformers applies it: only with
    use_sliding_window, and then to the layers from max_window_layers on
    (default 28), or to those `layer_types` names "sliding_attention". The
    engine's window is the same for every layer: none sliding or all."""
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window", False) or window is None:
        return None
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [
        "sliding_attention" if i >= int(raw.get("max_window_layers", 28)) else "full_attention"
        for i in range(layers)]
    if all(t == "full_attention" for t in types):
        return None
    if all(t == "sliding_attention" for t in types):
        return int(window)
    raise _refuse(source, "use_sliding_window", raw["use_sliding_window"],
                  f"the window applies to {sum(t == 'sliding_attention' for t in types)} of "
                  f"{layers} layers (max_window_layers / layer_types); the engine's window is "
                  "the same for every layer")


def architecture_fields(architecture: str, raw: dict[str, Any],
                        source: str) -> dict[str, Any]:
    """`ModelConfig` fields (and overrides) that depend on the architecture;
    raises UnsupportedModelError for a variant the engine does not run."""
    fields: dict[str, Any] = {}
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if architecture in ("Qwen3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM") and (
            act != "silu"):
        raise _refuse(source, "hidden_act", act, "the MLP is SwiGLU: silu only")
    partial = float(rope_parameters_of(raw, source).get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        if architecture != "Phi3ForCausalLM":
            raise _refuse(source, "partial_rotary_factor", partial,
                          f"{architecture} rotates whole heads; only Phi3ForCausalLM "
                          "rotates a fraction")
        fields["partial_rotary_factor"] = partial
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        fields["sliding_window"] = _qwen_sliding_window(raw, source)
    if architecture == "Qwen3ForCausalLM":
        fields["qk_norm"] = True
        if raw.get("attention_bias", False):
            raise _refuse(source, "attention_bias", raw["attention_bias"],
                          "Qwen3 with biases on q/k/v/o projections")
    elif architecture == "MixtralForCausalLM":
        try:
            fields["num_local_experts"] = int(raw["num_local_experts"])
            fields["num_experts_per_tok"] = int(raw["num_experts_per_tok"])
        except KeyError as exc:
            raise CheckpointError(f"{source}: required key {exc.args[0]!r} is missing") from None
    for key in ("attention_bias", "mlp_bias"):
        if architecture in ("Phi3ForCausalLM", "MixtralForCausalLM") and raw.get(key, False):
            raise _refuse(source, key, raw[key], f"{architecture} without biases only")
    return fields

"""`PerfModel`: how long a simulated pod's steps and KV transfers take.

Who uses it: the simulated engine loop (sim/engine_loop.py) asks
`step_seconds(plan)` for every step it runs, and the simulated prefill
pod's KV export (sim/kv_link.py) asks `transfer_seconds(...)` for every
request it "sends". Nothing here sleeps or knows about asyncio.

The model is a small linear formula, its coefficients loaded from a JSON
profile (sim/profiles/*.json, docs/simulator.md lists each with its
sources):

    step    = step_overhead_s
            + prefill_s_per_token  x prompt tokens computed in the step
            + decode_s_per_seq     x decoding rows (one new token each)
            + decode_s_per_context_token x context tokens those rows attend to

    transfer (after the last layer is computed) =
              link_latency_s + max(bytes / link_bytes_per_s - compute_s,
                                   bytes / link_bytes_per_s / num_layers)

The transfer term says what layer-wise streaming buys: KV of layer l is on
the wire while layer l+1 computes, so only what the link could not move
during the prompt's compute (and at least the last layer) is left after the
first token. A profile also sizes the simulated pod's KV cache
(`kv_cache_bytes`) the way `--kv-cache-memory` sizes a real one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.scheduler import SchedulerOutput

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"

_COEFFICIENTS = ("step_overhead_s", "prefill_s_per_token", "decode_s_per_seq",
                 "decode_s_per_context_token", "link_latency_s")
_POSITIVE = ("link_bytes_per_s", "kv_cache_bytes")
# one step longer than this is a typo in a profile, not a model
_MAX_STEP_S = 60.0


@dataclass(frozen=True, slots=True)
class PerfModel:
    """One profile's coefficients (seconds, bytes); see the module docstring."""

    name: str
    step_overhead_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    decode_s_per_context_token: float
    link_bytes_per_s: float
    link_latency_s: float
    kv_cache_bytes: int
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in _COEFFICIENTS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or \
                    not 0 <= value <= _MAX_STEP_S:
                raise ValueError(f"profile {self.name!r}: {name} must be a number of seconds "
                                 f"in [0, {_MAX_STEP_S:g}], got {value!r}")
        for name in _POSITIVE:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"profile {self.name!r}: {name} must be > 0, got {value!r}")

    # ------------------------------------------------------------ the model

    def step_seconds(self, plan: SchedulerOutput) -> float:
        """Modelled wall time of one engine step running `plan` (`plan_shape`)."""
        prompt_tokens, decode_rows, context = plan_shape(plan)
        return (self.step_overhead_s + self.prefill_s_per_token * prompt_tokens
                + self.decode_s_per_seq * decode_rows
                + self.decode_s_per_context_token * context)

    def prefill_seconds(self, num_tokens: int) -> float:
        """A prompt of `num_tokens` computed alone (the transfer's overlap)."""
        return self.step_overhead_s + self.prefill_s_per_token * num_tokens

    def transfer_seconds(self, num_bytes: int, num_layers: int, compute_s: float) -> float:
        """Time from the first token to the decode pod holding all `num_bytes`
        of KV, when the layers streamed out during `compute_s` of compute."""
        wire = num_bytes / self.link_bytes_per_s
        return self.link_latency_s + max(wire - compute_s, wire / max(1, num_layers))


def plan_shape(plan: SchedulerOutput) -> tuple[int, int, int]:
    """(prompt tokens, decode rows, context tokens) of one step's plan: a row of
    one token past its prompt is a decode row (it reads its whole context's
    KV), every other row's tokens are prompt tokens. `pdserve bench
    sim-profile` fits real steps on the same shape."""
    prompt_tokens = decode_rows = context = 0
    for row in plan.scheduled:
        if row.num_new_tokens == 1 and row.start >= row.request.num_context_tokens:
            decode_rows += 1
            context += row.end
        else:
            prompt_tokens += row.num_new_tokens
    return prompt_tokens, decode_rows, context


def load_profile(name_or_path: str) -> PerfModel:
    """A profile by file path, or by name from sim/profiles/ ("cpu-base").
    ValueError names a missing file, bad JSON or a bad coefficient."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise ValueError(f"performance profile {name_or_path!r} not found: give a JSON file "
                         f"or one of: {known}")
    try:
        raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"performance profile {path}: cannot read JSON: {exc}") from None
    return profile_from_dict(raw, source=str(path))


def profile_from_dict(raw: dict[str, Any], source: str = "profile") -> PerfModel:
    """A `PerfModel` from a profile's JSON object (unknown keys are refused,
    so a misspelt coefficient is not silently 0)."""
    fields = set(PerfModel.__dataclass_fields__) - {"name", "sources"}
    allowed = fields | {"name", "sources", "description", "derivation"}
    unknown = sorted(set(raw) - allowed)
    missing = sorted(fields - set(raw))
    if unknown or missing:
        raise ValueError(f"{source}: unknown keys {unknown}, missing keys {missing}; a profile "
                         f"has {sorted(fields)} (docs/simulator.md)")
    return PerfModel(name=str(raw.get("name", source)),
                     sources=tuple(str(s) for s in raw.get("sources", ())),
                     **{k: raw[k] for k in fields})

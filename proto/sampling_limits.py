"""Every sampling limit, and the one check of each sampling field.

A request's sampling is checked twice on its way, by two types: the router's
`SamplingSpec` (router/sampling.py) refuses a client's value with a 400, and
the engine's `SamplingParams` (engine/sampling_params.py: every pod, and
`LLMEngine` used directly) with a ValueError, which a pod answers with
INVALID_ARGUMENT. Both call `check_sampling` with their own `refuse`
(field, problem) -> exception, so a rule and its message are written once.

The two sides do not accept the same ranges, on purpose, and the
difference is the two tables below: `ENGINE_LIMITS` is what an engine can
compute (any temperature >= 0, any top_k, ...); `API_LIMITS` is what the
router takes from a client: OpenAI's ranges (temperature <= 2), vLLM's
top_k -1 for "off", the int32 of the wire for token ids and top_k, and caps
that bound the router's work per request (stop strings, stop token ids).
Every value the router accepts is one the pods accept.

Plain Python, no project imports: the router, which may not import the
engine's torch-heavy modules, and the engine both import it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

MAX_LOGPROBS = 20  # top alternatives per token, output and prompt
MAX_SEED = 2**64 - 1  # the wire's uint64
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI)
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100] (OpenAI)
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_INT32 = 2**31 - 1  # the wire's int32: top_k, token ids
MAX_API_TEMPERATURE = 2.0  # OpenAI's
MAX_API_REPETITION_PENALTY = 1e6
MAX_API_STOP_STRINGS = 16  # the router matches every stop string against each delta
MAX_API_STOP_TOKEN_IDS = 64

Refuse = Callable[[str, str], Exception]  # (field, problem) -> the exception to raise


@dataclass(frozen=True, slots=True)
class SamplingLimits:
    """The ranges one side accepts; `math.inf` = no upper bound.

    `min_top_k` is -1 where vLLM's "-1 = off" is accepted (the router stores
    it as 0); `max_token_id` bounds `logit_bias` keys and `stop_token_ids`
    (the vocabulary is checked separately, with `check_in_vocabulary`)."""

    max_temperature: float = math.inf
    min_top_k: int = 0
    max_top_k: float = math.inf
    max_repetition_penalty: float = math.inf
    max_stop_strings: float = math.inf
    max_stop_token_ids: float = math.inf
    max_token_id: float = math.inf


ENGINE_LIMITS = SamplingLimits()
API_LIMITS = SamplingLimits(
    max_temperature=MAX_API_TEMPERATURE,
    min_top_k=-1,
    max_top_k=MAX_INT32,
    max_repetition_penalty=MAX_API_REPETITION_PENALTY,
    max_stop_strings=MAX_API_STOP_STRINGS,
    max_stop_token_ids=MAX_API_STOP_TOKEN_IDS,
    max_token_id=MAX_INT32,
)


class SamplingFields(Protocol):
    """What `check_sampling` reads: fields the engine's `SamplingParams` and
    the router's `SamplingSpec` share. `max_tokens` None = not given yet (the
    router sets it from the context); `logit_bias` is token id -> bias, as a
    mapping (engine) or as (token id, bias) pairs (router)."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    logprobs: int | None
    prompt_logprobs: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]]
    min_tokens: int


def check_sampling(fields: SamplingFields, limits: SamplingLimits, refuse: Refuse, *,
                   may_score_only: bool) -> None:
    """Raise `refuse(field, problem)` for the first field outside `limits`.

    `may_score_only`: max_tokens 0 (prefill only, the prompt scored) is
    allowed. The engine always allows it; the router only when the client
    asked for the prompt back or scored (echo, prompt_logprobs)."""
    check_max_tokens(fields.max_tokens, refuse, may_score_only=may_score_only)
    _check_float("temperature", fields.temperature, 0.0, limits.max_temperature, refuse)
    _check_float("top_p", fields.top_p, 0.0, 1.0, refuse, open_low=True)
    _check_int("top_k", fields.top_k, limits.min_top_k, limits.max_top_k, refuse)
    if fields.seed is not None:
        _check_int("seed", fields.seed, 0, MAX_SEED, refuse)
    for name in ("logprobs", "prompt_logprobs"):
        if (value := getattr(fields, name)) is not None:
            _check_int(name, value, 0, MAX_LOGPROBS, refuse)
    check_stop(fields.stop, limits, refuse)
    for name in ("presence_penalty", "frequency_penalty"):
        _check_float(name, getattr(fields, name), -MAX_PENALTY, MAX_PENALTY, refuse)
    _check_float("repetition_penalty", fields.repetition_penalty, 0.0,
                 limits.max_repetition_penalty, refuse, open_low=True, note=" (1 = off)")
    bias = fields.logit_bias
    _check_logit_bias(bias.items() if isinstance(bias, Mapping) else bias, len(bias), limits,
                      refuse)
    _check_stop_token_ids(fields.stop_token_ids, limits, refuse)
    _check_min_tokens(fields.min_tokens, fields.max_tokens, refuse)


def check_max_tokens(max_tokens: int | None, refuse: Refuse, *, may_score_only: bool) -> None:
    """At least 1, or 0 where `may_score_only`; None (not given yet) passes."""
    if max_tokens is None or max_tokens >= 1 or (max_tokens == 0 and may_score_only):
        return
    if may_score_only:
        raise refuse("max_tokens", f"must be >= 0 (0 = score the prompt only), got {max_tokens}")
    hint = (" (0 only scores the prompt: with 'echo': true or 'prompt_logprobs')"
            if max_tokens == 0 else "")
    raise refuse("max_tokens", f"must be at least 1, got {max_tokens}{hint}")


def check_stop(stop: Sequence[str], limits: SamplingLimits, refuse: Refuse) -> None:
    """At most `limits.max_stop_strings` stop strings, none empty."""
    if len(stop) > limits.max_stop_strings:
        raise refuse("stop", f"may hold at most {_num(limits.max_stop_strings)} strings, got "
                             f"{len(stop)}")
    if any(not s for s in stop):
        raise refuse("stop", "strings must not be empty")


def check_in_vocabulary(name: str, token_ids: Iterable[int], vocab_size: int,
                        refuse: Refuse) -> None:
    """Refuse the first of `token_ids` the model cannot produce (the model is
    known only where the tokenizer is: the router's front door, the pods)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise refuse(name, f"holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def _check_logit_bias(pairs: Iterable[tuple[int, float]], count: int, limits: SamplingLimits,
                      refuse: Refuse) -> None:
    if count > MAX_LOGIT_BIAS_ENTRIES:
        raise refuse("logit_bias", f"may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got "
                                   f"{count}")
    for token, bias in pairs:
        if not 0 <= token <= limits.max_token_id:
            raise refuse("logit_bias", f"keys must be token ids "
                                       f"{_interval(0, limits.max_token_id)}, got {token}")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise refuse("logit_bias", f"values must be in [{_num(-MAX_LOGIT_BIAS)}, "
                                       f"{_num(MAX_LOGIT_BIAS)}], got {bias} for token {token}")


def _check_stop_token_ids(ids: Sequence[int], limits: SamplingLimits, refuse: Refuse) -> None:
    if len(ids) > limits.max_stop_token_ids:
        raise refuse("stop_token_ids", f"may hold at most {_num(limits.max_stop_token_ids)} "
                                       f"ids, got {len(ids)}")
    if any(not 0 <= t <= limits.max_token_id for t in ids):
        raise refuse("stop_token_ids", f"must be token ids {_interval(0, limits.max_token_id)}, "
                                       f"got {list(ids)}")


def _check_min_tokens(min_tokens: int, max_tokens: int | None, refuse: Refuse) -> None:
    if min_tokens < 0:
        raise refuse("min_tokens", f"must be >= 0, got {min_tokens}")
    if max_tokens is not None and min_tokens > max_tokens:
        raise refuse("min_tokens", f"must be at most max_tokens ({max_tokens}), got "
                                   f"{min_tokens}")


def _check_int(name: str, value: int, low: int, high: float, refuse: Refuse) -> None:
    if not low <= value <= high:
        raise refuse(name, f"must be {_interval(low, high)}, got {value}")


def _check_float(name: str, value: float, low: float, high: float, refuse: Refuse, *,
                 open_low: bool = False, note: str = "") -> None:
    """`value` finite, in [low, high] ((low, high] with `open_low`)."""
    above_low = value > low if open_low else value >= low
    if not (math.isfinite(value) and above_low and value <= high):
        finite = "a finite number " if high == math.inf else ""
        raise refuse(name, f"must be {finite}{_interval(low, high, open_low=open_low)}{note}, "
                           f"got {value}")


def _interval(low: float, high: float, *, open_low: bool = False) -> str:
    if high == math.inf:
        return f"{'>' if open_low else '>='} {_num(low)}"
    return f"in {'(' if open_low else '['}{_num(low)}, {_num(high)}]"


def _num(x: float) -> str:
    """2.0 as "2", 1e6 as "1000000": limits read as the client would write them."""
    return str(int(x)) if x == int(x) else str(x)

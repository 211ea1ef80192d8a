"""`SamplingParams`: how one request picks its tokens (validated at the boundary).

Mirrors `pdserve.v1.SamplingParams` in proto/pdserve.proto. Greedy when
`temperature == 0`. A request with `seed` draws output token i from a
generator seeded with (seed, i) (docs/architecture.md "Sampling
determinism"); without one it draws from the engine's generator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.grammar import GrammarSpec

MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI)
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings; every field is checked in `__post_init__`.

    `logprobs=n` returns, for each output token, its logprob and the top-n
    tokens' logprobs, all under the model's raw distribution
    (log_softmax of the logits before temperature, top-k and top-p; with a
    `grammar`, after its mask, as vLLM does).
    `prompt_logprobs=n` (vLLM's extension) returns, for each prompt token
    after the first, its logprob given the tokens before it and the top-n
    there (`engine.prompt_logprobs`); such a request skips the prefix cache.
    `max_tokens=0` scores the prompt only: the request ends after prefill
    with no output token (finish "length").
    `stop` strings are honoured by whoever detokenizes (`LLMEngine.generate`
    locally, the router when disaggregated); `stop_token_ids` by the engine.
    `grammar` (structured outputs, engine/grammar.py): every sampled token
    follows it, eos only where it accepts, and the request stops once it is
    complete.

    Logits adjustments (engine/logits_processors.py, before greedy argmax
    and temperature): `presence_penalty` / `frequency_penalty` (OpenAI,
    [-2, 2], over the output tokens so far), `repetition_penalty` (> 0,
    1 = off; positive logits of prompt and output tokens are divided by
    it, negative ones multiplied), `logit_bias` (token id -> bias in
    [-100, 100], at most 300 entries; ids checked against the vocabulary
    by the engine), `min_tokens` (EOS and `stop_token_ids` are masked out
    until that many tokens are out). `needs_logits_processing` is False
    when all are neutral: such a request samples exactly as before.
    The grammar's mask comes first, then these adjustments.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: GrammarSpec | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    needs_logits_processing: bool = field(init=False, default=False, compare=False)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0 = score the prompt only), "
                             f"got {self.max_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec or None, got "
                             f"{type(self.grammar).__name__}")
        self._check_logits_adjustments()
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs}")
        # Lists are accepted for convenience but stored as tuples (hashable, frozen).
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        object.__setattr__(self, "needs_logits_processing", bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens))

    def _check_logits_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got "
                             f"{self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                             f"got {len(self.logit_bias)}")
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, "
                                 f"{MAX_LOGIT_BIAS}], got {bias} for token {token}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got "
                             f"{self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

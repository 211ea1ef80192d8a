"""`SamplingParams`: how one request picks its tokens (validated at the boundary).

Mirrors `pdserve.v1.SamplingParams` in proto/pdserve.proto. Greedy when
`temperature == 0`. A request with `seed` draws output token i from a
generator seeded with (seed, i) (docs/architecture.md "Sampling
determinism"); without one it draws from the engine's generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings; every field is checked in `__post_init__`.

    `logprobs=n` returns, for each output token, its logprob and the top-n
    tokens' logprobs, all under the model's raw distribution
    (log_softmax of the logits before temperature, top-k and top-p).
    `prompt_logprobs=n` (vLLM's extension) returns, for each prompt token
    after the first, its logprob given the tokens before it and the top-n
    there (`engine.prompt_logprobs`); such a request skips the prefix cache.
    `max_tokens=0` scores the prompt only: the request ends after prefill
    with no output token (finish "length").
    `stop` strings are honoured by whoever detokenizes (`LLMEngine.generate`
    locally, the router when disaggregated); `stop_token_ids` by the engine.
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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs}")
        # Lists are accepted for convenience but stored as tuples (hashable, frozen).
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

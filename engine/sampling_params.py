"""`SamplingParams`: how one request picks its tokens (validated at the boundary).

Mirrors `pdserve.v1.SamplingParams` in proto/pdserve.proto. Greedy when
`temperature == 0`. A request with `seed` draws output token i from a
generator seeded with (seed, i) (docs/architecture.md "Sampling
determinism"); without one it draws from the engine's generator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.grammar import GrammarSpec
from proto.sampling_limits import ENGINE_LIMITS, check_sampling


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings; every field is checked in `__post_init__`
    against `ENGINE_LIMITS` (proto/sampling_limits.py, the one home of the
    limits, shared with the router), with a ValueError naming the field.

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
        check_sampling(self, ENGINE_LIMITS, _refuse, may_score_only=True)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec or None, got "
                             f"{type(self.grammar).__name__}")
        # Lists are accepted for convenience but stored as tuples (hashable, frozen).
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        object.__setattr__(self, "needs_logits_processing", bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _refuse(field_name: str, problem: str) -> ValueError:
    return ValueError(f"{field_name} {problem}")

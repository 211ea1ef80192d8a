"""`SamplingSpec`: one request's sampling, the router's one check of its
limits, and its wire form.

The router is the boundary in front of the pods, and this module is where it
checks sampling: both front doors build a `SamplingSpec` — the HTTP API from
the OpenAI body (router.http.requests), the gRPC API from
`pdserve.v1.SamplingParams` (`sampling_from_proto`) — and
`SamplingSpec.__post_init__` refuses any value out of its limit with a
`SamplingError`, so both doors refuse exactly the same values in the same
words. The limits and their checks are `API_LIMITS` and `check_sampling`
(proto/sampling_limits.py: the one home of the sampling limits, shared with
the engine's `SamplingParams`). `check_vocabulary` adds the token-id limit
of the model, and `fit_context` the one that needs the tokenized prompt
(prompt + max_tokens within the model's context). The flow sends the result
to the pods with `sampling_to_proto`.

Everything here is pure and runs on the router's event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.grammar import GrammarSpec, grammar_from_proto
from proto import pdserve_pb2 as pb
from proto.sampling_limits import API_LIMITS, check_in_vocabulary, check_sampling, check_stop
from proto.sampling_wire import sampling_fields_from_proto
from router.api_error import ApiError, bad_request

DEFAULT_COMPLETION_MAX_TOKENS = 16


class SamplingError(ValueError):
    """A sampling value outside its limit.

    `field` is the `SamplingSpec` field; the message reads
    "'<field>' <problem>". A front door whose clients call the field
    something else (OpenAI chat: `max_completion_tokens`, `top_logprobs`)
    words it with `worded_for(name)`."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(self.worded_for(field))

    def worded_for(self, name: str) -> str:
        return f"'{name}' {self.problem}"

    def to_api_error(self, name: str | None = None) -> ApiError:
        """The client's 400, naming the field as the client called it."""
        name = name or self.field
        return bad_request(self.worded_for(name), name)


def check_stop_strings(stop: Sequence[str]) -> None:
    """Raise SamplingError unless `stop` holds the API's number of non-empty strings."""
    check_stop(stop, API_LIMITS, SamplingError)


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Sampling for one request, limits checked; maps onto
    `pdserve.v1.SamplingParams`.

    `max_tokens` None = not given by the client: `fit_context` sets it once
    the prompt's length is known, and a `GenerationRequest` requires it set.
    `top_k` 0 = off (-1, vLLM's "off", is stored as 0). `logprobs` None =
    off, else the number of top alternatives per token (0 = only the
    sampled token's logprob). `prompt_logprobs` likewise for every prompt
    token after the first (computed where the prompt is). `echo`
    (completions): the prompt's text (and, with `logprobs`, its tokens'
    logprobs) comes before the output. `max_tokens` 0 only scores the
    prompt, so it needs `echo` or `prompt_logprobs` (docs/router.md, Echo).
    `grammar` (structured outputs, router.structured_output): None =
    unconstrained. The logits adjustments: penalties, `logit_bias` as sorted
    (token id, bias) pairs, `min_tokens`, `stop_token_ids`. Every field's
    limit is `API_LIMITS`' (proto/sampling_limits.py)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: GrammarSpec | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None
    echo: bool = False

    def __post_init__(self) -> None:
        check_sampling(self, API_LIMITS, SamplingError, may_score_only=self.scores_prompt)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)  # frozen: the one normalisation

    @property
    def scores_prompt(self) -> bool:
        """The client wants the prompt back (echo) or scored (prompt logprobs)."""
        return self.echo or self.prompt_logprobs is not None


def check_vocabulary(spec: SamplingSpec, vocab_size: int) -> None:
    """SamplingError for a token id the model cannot produce in `logit_bias`
    or `stop_token_ids` (needs the tokenizer: the front door calls it with
    the prompt)."""
    check_in_vocabulary("logit_bias", (t for t, _ in spec.logit_bias), vocab_size,
                        SamplingError)
    check_in_vocabulary("stop_token_ids", spec.stop_token_ids, vocab_size, SamplingError)


def fit_context(
    spec: SamplingSpec, *, chat: bool, num_prompt_tokens: int, max_model_len: int,
    pod_capacity: int = 0,
) -> SamplingSpec:
    """`spec` with max_tokens set and checked against the context and the
    pods; raise ApiError 400 naming the limit.

    Without max_tokens, completions get 16 new tokens (OpenAI's default),
    chat whatever room the context has left after the prompt, but never
    more than the largest pod that decodes can hold (`pod_capacity` tokens
    of KV, 0 = not known yet): the decode pod reserves prompt + max_tokens
    up front (docs/architecture.md "Decode reservation"). A request that no
    pod can hold is refused with that limit."""
    if num_prompt_tokens < 1:
        raise bad_request("the prompt is empty after tokenization", "prompt")
    room = max_model_len - num_prompt_tokens
    if room < 1 and not (spec.max_tokens == 0 and room == 0):  # scoring needs no room
        raise bad_request(
            f"the prompt is {num_prompt_tokens} tokens, which leaves no room in the model's "
            f"context of {max_model_len} tokens",
            "messages" if chat else "prompt",
        )
    held = pod_capacity - num_prompt_tokens if pod_capacity else room
    max_tokens = spec.max_tokens
    if max_tokens is None:
        max_tokens = min(room, held) if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room, held)
        if max_tokens < 1:
            raise bad_request(
                f"the prompt is {num_prompt_tokens} tokens; the largest decode pod holds KV "
                f"for {pod_capacity} tokens, which leaves no room to generate",
                "messages" if chat else "prompt",
            )
    elif max_tokens > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; the prompt is "
            f"{num_prompt_tokens} tokens and max_tokens is {max_tokens} "
            f"({num_prompt_tokens + max_tokens} in total): lower max_tokens to at most {room}",
            "max_tokens",
        )
    elif max_tokens > held:
        raise bad_request(
            f"the largest decode pod holds KV for {pod_capacity} tokens; the prompt is "
            f"{num_prompt_tokens} tokens and max_tokens is {max_tokens}: lower max_tokens to "
            f"at most {max(held, 0)}",
            "max_tokens",
        )
    try:
        return replace(spec, max_tokens=max_tokens)
    except SamplingError as exc:  # min_tokens above the default max_tokens
        raise exc.to_api_error() from None


# ---------------------------------------------------------------- wire form


def sampling_from_proto(message: pb.SamplingParams) -> SamplingSpec:
    """A gRPC client's SamplingParams as a checked SamplingSpec (SamplingError
    when a value is out of its limit). The zeros read as proto/sampling_wire.py
    says, except max_tokens: 0 is "not given", which `fit_context` sets."""
    try:
        grammar = grammar_from_proto(message)
    except ValueError as exc:
        raise SamplingError("grammar", str(exc)) from None
    return SamplingSpec(max_tokens=message.max_tokens or None, grammar=grammar,
                        **sampling_fields_from_proto(message))


def sampling_to_proto(spec: SamplingSpec) -> pb.SamplingParams:
    """The wire form the pods get; `spec.max_tokens` must be set. Pods send
    logprobs only for n > 0, so "just the sampled token's logprob" (n = 0)
    asks for one alternative and the response shaper shows none — the one
    way in which this is not `sampling_from_proto`'s inverse."""
    assert spec.max_tokens is not None, "fit_context sets max_tokens before the flow starts"
    message = pb.SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        max_tokens=spec.max_tokens,
        ignore_eos=spec.ignore_eos,
        logprobs=0 if spec.logprobs is None else max(1, spec.logprobs),
        stop=list(spec.stop),
        prompt_logprobs=0 if spec.prompt_logprobs is None else max(1, spec.prompt_logprobs),
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        min_tokens=spec.min_tokens,
        stop_token_ids=list(spec.stop_token_ids),
        logit_bias=dict(spec.logit_bias),
    )
    if spec.seed is not None:
        message.seed = spec.seed
    if spec.grammar is not None:  # the oneof's field name is the kind
        message.grammar.MergeFrom(pb.Grammar(**{spec.grammar.kind.value: spec.grammar.text}))
    return message

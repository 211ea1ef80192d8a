"""Conversions between `pdserve.v1` messages and engine types, with the
boundary checks every pod applies before a request reaches its engine.

Called by the prefill and decode servicers on the pod's event loop:
`check_request` is the validation preamble of `Prefill.Prefill` and
`Decode.Generate`. Every check raises `ValueError` with a message naming the
field and the limit, which the servicers' status map (pod/errors.py) turns
into INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.grammar import grammar_from_proto
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2
from proto.request_id import check_request_id
from proto.sampling_limits import check_in_vocabulary
from proto.sampling_wire import sampling_fields_from_proto


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a request's tokens are checked against on this pod."""

    vocab_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.max_model_len < 1:
            raise ValueError(f"vocab_size and max_model_len must be >= 1, got {self}")


def sampling_from_proto(msg: pdserve_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams (ValueError naming a field out of its
    limit). The zeros read as proto/sampling_wire.py says; max_tokens 0
    scores the prompt only."""
    fields = sampling_fields_from_proto(msg)
    return SamplingParams(**fields | {"logit_bias": dict(fields["logit_bias"])},
                          max_tokens=msg.max_tokens, grammar=grammar_from_proto(msg))


def check_context(prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                  params: SamplingParams, limits: ModelLimits) -> None:
    """Refuse a request the model cannot hold: empty prompt, ids outside the
    vocabulary, or context + tokens still to generate over max_model_len."""
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids must be non-empty")
    for name, ids in (("prompt_token_ids", prompt_token_ids),
                      ("output_token_ids", output_token_ids)):
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name} contains {bad}, outside the vocabulary [0, "
                             f"{limits.vocab_size})")
    check_in_vocabulary("logit_bias", params.logit_bias, limits.vocab_size, _refuse)
    if output_token_ids and len(output_token_ids) >= params.max_tokens:
        raise ValueError(f"output_token_ids already holds {len(output_token_ids)} tokens, "
                         f"max_tokens is {params.max_tokens}")
    context = len(prompt_token_ids) + len(output_token_ids)
    total = len(prompt_token_ids) + params.max_tokens
    if total > limits.max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
            f"{total} exceeds max_model_len {limits.max_model_len}"
            if context < limits.max_model_len else
            f"context of {context} tokens exceeds max_model_len {limits.max_model_len}"
        )


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A `PrefillRequest` or `DecodeGenerateRequest` that passed `check_request`."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams


def check_request(request: pdserve_pb2.PrefillRequest | pdserve_pb2.DecodeGenerateRequest,
                  limits: ModelLimits) -> CheckedRequest:
    """The checks both pod services run first: request id, sampling, token ids
    and lengths. ValueError (-> INVALID_ARGUMENT) names the first bad field."""
    check_request_id(request.request_id)
    params = sampling_from_proto(request.sampling)
    prompt, outputs = list(request.prompt_token_ids), list(request.output_token_ids)
    check_context(prompt, outputs, params, limits)
    return CheckedRequest(request.request_id, prompt, outputs, params)


def _refuse(field: str, problem: str) -> ValueError:
    return ValueError(f"{field} {problem}")


def logprob_to_proto(lp: TokenLogprobs) -> pdserve_pb2.TokenLogprob:
    return pdserve_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top_token_ids=list(lp.top_token_ids), top_logprobs=list(lp.top_logprobs),
    )

"""How a `pdserve.v1.SamplingParams` reads: the proto3 "zero = unset" rules,
written once for both of its readers.

proto3 cannot tell an unset scalar from a zero, so `pdserve.proto` gives
zeros a meaning: top_p 0 is 1 (off), logprobs and prompt_logprobs 0 are
none, repetition_penalty 0 is 1 (off), and seed is `optional` (unset = the
pod's generator); temperature 0 is greedy. `sampling_fields_from_proto`
applies them; a pod builds the engine's `SamplingParams` from the result
(pod/messages.py), the router's gRPC API its `SamplingSpec`
(router/sampling.py), and each checks the values against its limits
(proto/sampling_limits.py).

Two fields are not here. `max_tokens`, whose 0 the readers read differently:
on a pod it is a request that only scores its prompt, at the router's API a
client that left it to the context (`fit_context`). And `grammar`, whose type
is the engine's (`engine.grammar.grammar_from_proto`).

No project imports but the generated module.
"""

from __future__ import annotations

from typing import TypedDict

from proto import pdserve_pb2 as pb


class WireSampling(TypedDict):
    """The shared fields as `SamplingParams` / `SamplingSpec` keyword arguments."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: tuple[tuple[int, float], ...]  # (token id, bias), sorted by token id
    min_tokens: int


def sampling_fields_from_proto(message: pb.SamplingParams) -> WireSampling:
    """`message`'s fields but max_tokens and grammar, its zeros read as the
    proto defines them. Unchecked: a negative logprobs stays negative, for the
    reader's check to refuse."""
    return WireSampling(
        temperature=message.temperature,
        top_p=message.top_p or 1.0,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs or None,
        prompt_logprobs=message.prompt_logprobs or None,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        min_tokens=message.min_tokens,
    )

"""The checks a request must pass before an `LLMEngine` takes it
(`add_request`, `reserve_remote`): everything a caller can get wrong,
each refused with a ValueError that names it. Engine thread (pure).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from engine.block_manager import cdiv
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What this engine can hold: its vocabulary, its context limit, and its
    KV cache in blocks of `block_size` tokens."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_total_blocks: int


def check_new_request(request_id: str, prompt_token_ids: Sequence[int],
                      sampling_params: SamplingParams, output_token_ids: Sequence[int], *,
                      ids_in_use: Container[str], limits: RequestLimits) -> None:
    """Raise ValueError naming the first problem: params of the wrong type, an
    id in use, an empty prompt, a token or logit_bias id outside the
    vocabulary, no output left under max_tokens, a context over
    max_model_len, or more blocks than the cache has."""
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got "
                         f"{type(sampling_params).__name__}")
    if request_id in ids_in_use:
        raise ValueError(f"request_id {request_id!r} is already in use")
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids must not be empty")
    vocab = limits.vocab_size
    bad = [t for t in (*prompt_token_ids, *output_token_ids) if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    bad = [t for t in sampling_params.logit_bias if t >= vocab]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if output_token_ids and len(output_token_ids) >= sampling_params.max_tokens:
        raise ValueError(f"output_token_ids has {len(output_token_ids)} tokens, nothing "
                         f"left to generate under max_tokens {sampling_params.max_tokens}")
    total = len(prompt_token_ids) + sampling_params.max_tokens
    if total > limits.max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
            f"({sampling_params.max_tokens}) = {total} exceeds max_model_len "
            f"{limits.max_model_len}"
        )
    if cdiv(total, limits.block_size) > limits.num_total_blocks:
        raise ValueError(
            f"prompt + max_tokens = {total} tokens needs more than the "
            f"{limits.num_total_blocks} KV blocks of {limits.block_size} "
            f"this engine has"
        )

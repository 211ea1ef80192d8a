"""The limits of the sampling fields that adjust logits (penalties,
`logit_bias`, `min_tokens`, `stop_token_ids`), checked by
`SamplingSpec.__post_init__` (router.sampling) for both front doors, and
their wire form. The pods apply them (engine/logits_processors.py); the
ranges are the engine's (engine/sampling_params.py), refused here first so
the client gets a 400 naming the field before anything is routed.

Pure; runs on the router's event loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from proto import pdserve_pb2 as pb

if TYPE_CHECKING:
    from router.sampling import SamplingSpec

MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_STOP_TOKEN_IDS = 64

Refuse = Callable[[str, str], Exception]  # (field, problem) -> the error to raise


def check_logits_fields(spec: SamplingSpec, refuse: Refuse) -> None:
    """Raise `refuse(field, problem)` for the first field out of its limit."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(spec, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise refuse(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    if not (math.isfinite(spec.repetition_penalty) and 0 < spec.repetition_penalty <= 1e6):
        raise refuse("repetition_penalty", f"must be > 0 (1 = off), got {spec.repetition_penalty}")
    if len(spec.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise refuse("logit_bias", f"may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got "
                                   f"{len(spec.logit_bias)}")
    for token, bias in spec.logit_bias:
        if not 0 <= token < 2**31:
            raise refuse("logit_bias", f"keys must be token ids >= 0, got {token}")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise refuse("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, "
                                       f"{MAX_LOGIT_BIAS:g}], got {bias} for token {token}")
    if len(spec.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise refuse("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                                       f"{len(spec.stop_token_ids)}")
    if any(not 0 <= t < 2**31 for t in spec.stop_token_ids):
        raise refuse("stop_token_ids", f"must be token ids >= 0, got {list(spec.stop_token_ids)}")
    if spec.min_tokens < 0:
        raise refuse("min_tokens", f"must be >= 0, got {spec.min_tokens}")
    if spec.max_tokens is not None and spec.min_tokens > spec.max_tokens:
        raise refuse("min_tokens", f"must be at most max_tokens ({spec.max_tokens}), got "
                                   f"{spec.min_tokens}")


def check_vocabulary(spec: SamplingSpec, vocab_size: int, refuse: Refuse) -> None:
    """Token ids the model cannot produce (needs the tokenizer: the front
    door calls it with the prompt)."""
    for name, ids in (("logit_bias", [t for t, _ in spec.logit_bias]),
                      ("stop_token_ids", spec.stop_token_ids)):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise refuse(name, f"holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def logits_fields_to_proto(spec: SamplingSpec, message: pb.SamplingParams) -> None:
    """Fill `message`'s logits-adjustment fields from `spec`."""
    message.presence_penalty = spec.presence_penalty
    message.frequency_penalty = spec.frequency_penalty
    message.repetition_penalty = spec.repetition_penalty
    message.min_tokens = spec.min_tokens
    message.stop_token_ids.extend(spec.stop_token_ids)
    for token, bias in spec.logit_bias:
        message.logit_bias[token] = bias


def logits_fields_from_proto(message: pb.SamplingParams) -> dict:
    """SamplingSpec keyword arguments from a gRPC client's SamplingParams
    (repetition_penalty 0 = unset = 1)."""
    return dict(
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        min_tokens=message.min_tokens,
        stop_token_ids=tuple(message.stop_token_ids),
    )

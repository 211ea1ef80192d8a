"""Messages the engine hands out: per-step `RequestOutput`, `generate()`
results, decode-pod `RemoteReservation`, and load `EngineStats`.

All frozen: the engine loop thread builds them, other threads (servicers,
the stats reader) only read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.request import Request

FINISH_REASONS = ("stop", "length", "abort", "prefill_done")


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's logprob and the top-n alternatives (raw distribution:
    log_softmax of the logits before temperature/top-k/top-p), best first."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.top_token_ids) != len(self.top_logprobs):
            raise ValueError(
                f"{len(self.top_token_ids)} top_token_ids but {len(self.top_logprobs)} logprobs"
            )


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request.

    `new_token_ids` are the tokens sampled this step (empty when a request
    only finishes, e.g. aborted, or a committed remote request whose first
    token already ended it). `new_logprobs` is filled when the request asked
    for logprobs. The last output of a request has `finish_reason` set.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # Once, with the first token (or the finish of a max_tokens=0 request), on
    # the pod that computed the prompt of a request with prompt_logprobs:
    # entries for prompt tokens 1..P-1 (engine.prompt_logprobs).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # when a step first computed tokens of it (time.monotonic, this process;
    # None for a request whose prompt another pod computed) and how often it
    # was preempted: the phases of its trace (docs/tracing.md)
    first_scheduled_at: float | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason must be None or one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )

    @classmethod
    def of(cls, request: Request, new_token_ids: tuple[int, ...],
           new_logprobs: tuple[TokenLogprobs, ...],
           prompt_logprobs: tuple[TokenLogprobs, ...] | None = None) -> RequestOutput:
        """`request`'s output now (its counts and finish reason as they stand)."""
        return cls(request_id=request.request_id, new_token_ids=new_token_ids,
                   new_logprobs=new_logprobs, finish_reason=request.status.finish_reason,
                   num_prompt_tokens=request.num_prompt_tokens,
                   num_cached_tokens=request.num_cached_tokens,
                   num_output_tokens=request.num_output_tokens,
                   prompt_logprobs=prompt_logprobs,
                   first_scheduled_at=request.first_scheduled_at,
                   num_preemptions=request.num_preemptions)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One finished request of `LLMEngine.generate()`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str | None  # None when the model directory has no tokenizer
    finish_reason: str
    logprobs: tuple[TokenLogprobs, ...]
    num_cached_tokens: int
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # tokens 1..P-1, when asked


@dataclass(frozen=True, slots=True)
class RemoteReservation:
    """Blocks a decode pod holds for a request whose KV a prefill pod sends.

    The first `num_held_tokens` context tokens (prompt + output_token_ids)
    are already in the cache: whole blocks of the prefix cache, pinned by
    the request (0 without the prefix cache). `slot_mapping[i]` (int64, on
    the cache device) is the slot of context token `num_held_tokens + i`:
    the injector writes the received `[2, num_context_tokens -
    num_held_tokens, Hkv, D]` layer with
    `kernels.inject_kv(kv_cache_layer, src, slot_mapping)`. `block_ids` also
    cover the remaining max_tokens, so the request never needs more blocks.
    """

    request_id: str
    block_ids: tuple[int, ...]
    block_size: int
    num_context_tokens: int
    slot_mapping: torch.Tensor
    num_held_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.num_held_tokens < self.num_context_tokens:
            raise ValueError(f"num_held_tokens {self.num_held_tokens} must be in "
                             f"[0, {self.num_context_tokens}) (at least one token is sent)")
        if tuple(self.slot_mapping.shape) != (self.num_new_tokens,):
            raise ValueError(
                f"slot_mapping shape {tuple(self.slot_mapping.shape)} must be "
                f"[{self.num_new_tokens}]"
            )
        if len(self.block_ids) * self.block_size < self.num_context_tokens:
            raise ValueError(
                f"{len(self.block_ids)} blocks of {self.block_size} cannot hold "
                f"{self.num_context_tokens} context tokens"
            )

    @property
    def num_new_tokens(self) -> int:
        """Context tokens whose KV the prefill pod sends."""
        return self.num_context_tokens - self.num_held_tokens


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counts for GetLoad and the gauges (`LLMEngine.stats()`). Prefix-cache
    counters are cumulative, in blocks."""

    num_waiting: int
    num_waiting_tokens: int  # context tokens of waiting requests not yet computed
    num_running: int
    num_reserved: int  # decode pod: WAITING_FOR_REMOTE_KV
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int  # cumulative
    num_reserved_blocks: int = 0  # blocks held by the num_reserved requests

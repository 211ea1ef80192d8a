"""`Request`: one sequence's state inside the engine, and its status machine.

Life cycle (transitions checked by `Request.transition`):

    add_request ──> WAITING ──schedule──> RUNNING ──sample──> FINISHED_STOPPED
                       ^                   │  │                FINISHED_LENGTH
                       │                   │  └─prefill_only─> FINISHED_PREFILL_DONE
                       └──resume── PREEMPTED <─┘ (blocks freed, recompute)
    reserve_remote ─> WAITING_FOR_REMOTE_KV ──commit_remote──> RUNNING
                                            └─(first token ends it)─> FINISHED_*
    abort_request: any unfinished state ──> FINISHED_ABORTED

A PREEMPTED request waits at the head of the waiting queue; on resume it
re-prefills prompt + outputs so far (outputs are then context).

Only the engine loop thread touches a `Request`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_PREFILL_DONE = "finished_prefill_done"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason: "stop", "length", "abort", "prefill_done"."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_PREFILL_DONE: "prefill_done",
}

_S = RequestStatus
_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.FINISHED_ABORTED}),
    # A committed first token may already end the request (eos, stop id, max_tokens).
    _S.WAITING_FOR_REMOTE_KV: frozenset(
        {_S.RUNNING, _S.FINISHED_STOPPED, _S.FINISHED_LENGTH, _S.FINISHED_ABORTED}
    ),
    _S.RUNNING: frozenset(
        {_S.PREEMPTED, _S.FINISHED_STOPPED, _S.FINISHED_LENGTH, _S.FINISHED_ABORTED,
         _S.FINISHED_PREFILL_DONE}
    ),
    # Async scheduling: a token sampled by a step that was in flight when the
    # request was preempted is still appended, and may end it.
    _S.PREEMPTED: frozenset({_S.RUNNING, _S.FINISHED_STOPPED, _S.FINISHED_LENGTH,
                             _S.FINISHED_ABORTED, _S.FINISHED_PREFILL_DONE}),
    **{s: frozenset() for s in _FINISH_REASONS},
}


class Request:
    """Mutable per-sequence state; created by `LLMEngine`, advanced by the scheduler.

    Invariants: `all_token_ids == prompt + outputs` (append-only);
    `num_computed_tokens <= num_tokens_with_placeholders`; `block_ids` is
    append-only while the request holds blocks and covers at least
    `num_computed_tokens` slots.

    Output placeholders: the scheduler counts a token as soon as a step that
    samples it is scheduled (`num_output_placeholders`), so the next step can
    be planned before the token is known (async scheduling); appending the
    token replaces the oldest placeholder. `last_step_id` is the newest
    scheduled step that computes tokens of this request: its blocks may only
    go back to the pool once that step has completed.
    """

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "prefill_only",
                 "all_token_ids", "num_context_tokens", "status", "num_computed_tokens",
                 "num_cached_tokens", "block_ids", "block_hashes", "num_cached_blocks",
                 "num_kv_streamed", "was_scheduled", "num_output_placeholders",
                 "last_step_id", "prompt_logprobs", "num_prompt_logprobs_planned",
                 "first_scheduled_at", "num_preemptions", "prefix_wait_since")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, *, output_token_ids: Sequence[int] = (),
                 prefill_only: bool = False,
                 status: RequestStatus = RequestStatus.WAITING) -> None:
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.sampling_params = sampling_params
        self.prefill_only = prefill_only
        self.all_token_ids = [*self.prompt_token_ids, *output_token_ids]
        # Tokens that are context on arrival (prompt + outputs of a migration):
        # the range a prefill pod streams.
        self.num_context_tokens = len(self.all_token_ids)
        self.status = status
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit on first schedule
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # full blocks of all_token_ids
        self.num_cached_blocks = 0  # leading blocks already inserted in the prefix cache
        self.num_kv_streamed = 0  # context tokens already handed to the LayerKVHook
        self.was_scheduled = False
        # when a step first computed tokens of it (time.monotonic; None until
        # then): its queue wait ends there (request traces, docs/tracing.md)
        self.first_scheduled_at: float | None = None
        self.num_preemptions = 0  # times preempted by recompute
        # first time it waited for a prefix another request computes (engine/prefix_wait.py)
        self.prefix_wait_since: float | None = None
        self.num_output_placeholders = 0  # sampled by a scheduled step, not yet appended
        self.last_step_id = -1  # newest step that computes tokens of this request
        # Prompt logprobs computed here (engine.prompt_logprobs): entries for
        # prompt tokens 1, 2, ... in order; None when not asked for or when
        # another pod computes the prompt (a remote reservation). Positions
        # already planned into a step are never planned again (preemption).
        self.prompt_logprobs: list | None = (
            [] if sampling_params.prompt_logprobs is not None else None)
        self.num_prompt_logprobs_planned = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus the ones scheduled steps will sample: what the
        scheduler plans against."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def ends_with_placeholders(self) -> bool:
        """The tokens in flight already end the request (prefill-only requests
        stop at their first token; max_tokens is reached), so nothing more is
        scheduled for it."""
        ph = self.num_output_placeholders
        return ph > 0 and (self.prefill_only or self.num_output_tokens + ph
                           >= self.sampling_params.max_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        """Append a sampled (or committed) token; it replaces the oldest placeholder."""
        self.all_token_ids.append(token_id)
        if self.num_output_placeholders:
            self.num_output_placeholders -= 1

    def transition(self, new_status: RequestStatus) -> None:
        """Move to `new_status`, refusing a transition the life cycle does not allow."""
        if new_status not in _ALLOWED[self.status]:
            raise RuntimeError(
                f"request {self.request_id!r}: illegal transition "
                f"{self.status.name} -> {new_status.name}"
            )
        self.status = new_status

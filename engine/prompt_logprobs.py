"""Prompt logprobs: each prompt token's logprob given the tokens before it.

Asked for per request (`SamplingParams.prompt_logprobs = n`; the OpenAI
`echo` + `logprobs` of /v1/completions, lm-evaluation-harness's
log-likelihood requests). Prompt token i (i >= 1) is scored by the hidden
state of position i - 1: `log_softmax(lm_head(h[i - 1]))[token i]`, plus
the top-n there. Token 0 has no logprob (nothing predicts it), so a prompt
of P tokens gets P - 1 entries. The raw distribution, as output logprobs.

Only requests that ask pay: `plan_prompt_logprobs` looks at each scheduled
request's `Request.prompt_logprobs` (None unless asked) and returns None for
a step without any, and the forward then computes what it always did (the
sampled rows' logits). With chunked prefill a step scores the positions of
the chunk it computes; a request preempted and recomputed never scores a
position twice (`Request.num_prompt_logprobs_planned`).

Positions whose KV comes from the prefix cache are never computed, so they
would have no logits: a request that asks for prompt logprobs skips the
prefix cache (`BlockManager.match_prefix`) and computes its whole prompt.

Threads: `plan_prompt_logprobs` and `deliver` run on the engine loop thread
(they read and write requests); `compute_prompt_logprobs` runs wherever the
forward runs (the CPU forward worker, or queued on the CUDA stream) and
touches only tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.host_copy import to_device
from engine.outputs import TokenLogprobs
from engine.request import Request
from engine.scheduler import ScheduledRequest

# Rows scored per lm_head call: bounds the float32 [rows, vocab] logits a
# long chunk would otherwise materialise at once (256 x 128k vocab = 128 MiB).
ROWS_PER_SLICE = 256


@dataclass(frozen=True, slots=True)
class PromptLogprobsSpan:
    """`request`'s prompt tokens `first_token .. first_token + len(token_ids)`
    (prompt indices, >= 1) are scored by consecutive rows of the plan."""

    request: Request
    first_token: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PromptLogprobsPlan:
    """The hidden rows a step scores and the token each row scores, in span order."""

    rows: torch.Tensor  # [m] int64, rows of the step's hidden states (on the device)
    targets: torch.Tensor  # [m] int64 token ids (on the device)
    spans: tuple[PromptLogprobsSpan, ...]
    num_top: int  # the largest n asked for in this step


@dataclass(frozen=True, slots=True)
class PromptLogprobsTensors:
    """`chosen[j]` is the logprob of plan row j's target; `top_*[j]` its top-n."""

    chosen: torch.Tensor  # [m] float32
    top_values: torch.Tensor | None  # [m, num_top] float32
    top_ids: torch.Tensor | None  # [m, num_top] int64

    def to(self, device: torch.device | str, *, non_blocking: bool = False
           ) -> PromptLogprobsTensors:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return PromptLogprobsTensors(move(self.chosen), move(self.top_values),
                                     move(self.top_ids))


def plan_prompt_logprobs(ordered: Sequence[ScheduledRequest],
                         device: torch.device) -> PromptLogprobsPlan | None:
    """Engine loop thread. `ordered` in the step's row order (row offsets are
    the running sum of `num_new_tokens`). Marks the planned positions on
    the requests; None when no scheduled request scores a prompt position."""
    rows: list[int] = []
    spans: list[PromptLogprobsSpan] = []
    row = 0
    for s in ordered:
        r = s.request
        if r.prompt_logprobs is not None:
            # position p's row scores prompt token p + 1; the last prompt
            # position predicts the first output token, not a prompt token
            first = max(s.start, r.num_prompt_logprobs_planned)
            last = min(s.end, r.num_prompt_tokens - 1)
            assert s.start <= r.num_prompt_logprobs_planned or first >= last, (
                f"{r.request_id}: prompt positions [{r.num_prompt_logprobs_planned}, "
                f"{s.start}) were never computed (a prefix-cache hit?)")
            if first < last:
                rows.extend(range(row + first - s.start, row + last - s.start))
                spans.append(PromptLogprobsSpan(r, first + 1,
                                                r.prompt_token_ids[first + 1 : last + 1]))
                r.num_prompt_logprobs_planned = last
        row += s.num_new_tokens
    if not spans:
        return None
    targets = [t for span in spans for t in span.token_ids]
    return PromptLogprobsPlan(
        rows=to_device(torch.tensor(rows, dtype=torch.long), device),
        targets=to_device(torch.tensor(targets, dtype=torch.long), device),
        spans=tuple(spans),
        num_top=max(span.request.sampling_params.prompt_logprobs for span in spans))


def compute_prompt_logprobs(hidden: torch.Tensor, plan: PromptLogprobsPlan,
                            compute_logits: Callable[[torch.Tensor], torch.Tensor]
                            ) -> PromptLogprobsTensors:
    """The plan's rows through lm_head and log_softmax, `ROWS_PER_SLICE` at a
    time (forward thread; reads no request)."""
    chosen, values, ids = [], [], []
    for i in range(0, plan.rows.numel(), ROWS_PER_SLICE):
        logprobs = compute_logits(hidden[plan.rows[i : i + ROWS_PER_SLICE]]).float()
        logprobs = logprobs.log_softmax(dim=-1)
        targets = plan.targets[i : i + ROWS_PER_SLICE, None]
        chosen.append(logprobs.gather(1, targets).squeeze(1))
        if plan.num_top:
            top_values, top_ids = logprobs.topk(plan.num_top, dim=-1)
            values.append(top_values)
            ids.append(top_ids)
    return PromptLogprobsTensors(torch.cat(chosen),
                                 torch.cat(values) if values else None,
                                 torch.cat(ids) if ids else None)


def deliver(plan: PromptLogprobsPlan, tensors: PromptLogprobsTensors) -> None:
    """Engine loop thread, once the step completed (`tensors` on the host):
    append each span's entries to its request. Steps complete in order, so
    a request's spans arrive in prompt order."""
    chosen = tensors.chosen.tolist()
    top_values = tensors.top_values.tolist() if tensors.top_values is not None else None
    top_ids = tensors.top_ids.tolist() if tensors.top_ids is not None else None
    j = 0
    for span in plan.spans:
        r = span.request
        entries = r.prompt_logprobs
        if entries is not None and not r.is_finished:
            assert len(entries) + 1 == span.first_token, (r.request_id, len(entries), span)
            n = r.sampling_params.prompt_logprobs
            for k, token_id in enumerate(span.token_ids):
                row = j + k
                entries.append(TokenLogprobs(
                    token_id, chosen[row],
                    tuple(top_ids[row][:n]) if n else (),
                    tuple(top_values[row][:n]) if n else ()))
        j += len(span.token_ids)


def take_prompt_logprobs(request: Request) -> tuple[TokenLogprobs, ...] | None:
    """The request's prompt logprobs once they are all computed, exactly once
    (the engine attaches them to the output with the first token, or to the
    finishing output of a max_tokens=0 request); None otherwise."""
    entries = request.prompt_logprobs
    if entries is None or len(entries) < request.num_prompt_tokens - 1:
        return None
    request.prompt_logprobs = None
    return tuple(entries)

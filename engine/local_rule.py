"""`LocalAsk`: when a decode pod computes a prompt it was asked to reserve
for (conditional disaggregation), instead of waiting for a prefill pod's KV.

A reservation (`LLMEngine.reserve_remote`) may carry two rules; either one
that holds makes the pod queue the request as its own prompt, and the
reply is tokens instead of a reservation:

* `below` T > 0 (the router's `--local-prefill-below`): fewer than T new
  tokens are left after the pod's cached prefix;
* `beyond` B (the router's `--local-prefill-within-budget`, on by default;
  B is the prefix the prefill path already caches, from the router's
  index): the pod's cached prefix is longer than B, so it holds KV the
  prefill pod would compute again (typically the previous turn's answer,
  which this pod generated), no other prompt work is queued here, and the
  pod finishes the new tokens sooner than the prefill pod would compute its
  part: here, steps of what fits the pod's inter-token budget beside its
  running batch (engine/itl_budget.py, at most `mixed_prefill_tokens` a
  step), each as long as the pod's step-time model predicts; there, the
  context after B in one step at this pod's per-token cost (equal hardware;
  the transfer, the hops and the prefill queue are left out, so the rule
  leans to the P/D path). Computing a turn here leaves the prefill pod's
  cache a turn behind, which makes the next turn's P/D path costlier and
  this rule likelier: a conversation's turns then stay where their history
  is, each token computed once. While the step-time model is still
  learning, only what fits one probe step beside the batch qualifies. The
  running streams' token gaps stay within the budget by construction. A
  pod without a budget never takes this rule: nothing bounds what the
  prompt would cost its streams.

Called on the engine loop thread (it reads the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.itl_budget import PROBE_TOKENS

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class LocalAsk:
    below: int = 0  # 0: off
    beyond: int | None = None  # None: off

    def __post_init__(self) -> None:
        if self.below < 0:
            raise ValueError(f"local_prefill_below must be >= 0, got {self.below}")
        if self.beyond is not None and self.beyond < 0:
            raise ValueError(f"prefill_cached_tokens must be >= 0, got {self.beyond}")

    def computes_here(self, scheduler: Scheduler, cached: int, new: int) -> bool:
        """`cached`: the pod's cached prefix of the context; `new`: the
        context tokens after it."""
        if self.below and new < self.below:
            return True
        if self.beyond is None or cached <= self.beyond:
            return False
        budget = scheduler.itl_budget
        if budget is None:
            return False
        if scheduler.waiting or any(
                r.num_tokens_with_placeholders - r.num_computed_tokens > 1
                for r in scheduler.running):
            return False  # prompt work queued already: this one would wait behind it
        cap = scheduler.mixed_prefill_tokens
        here = budget.seconds_here(cached, new, cap)
        if here is None:  # the step-time model is still learning
            return new <= min(cap or PROBE_TOKENS, PROBE_TOKENS) and \
                budget.fits_beside_last_step(cached, new)
        return here <= budget.seconds_alone(self.beyond, cached + new - self.beyond)

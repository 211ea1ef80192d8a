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
  which this pod generated); no other prompt work is queued here; and the
  new tokens fit the pod's next step within its inter-token budget
  (engine/itl_budget.py) beside its decoding rows, or beside one row when
  none decodes (a stream may join an idle pod's step, which is not capped),
  and within its prompt-chunk cap (`mixed_prefill_tokens`). The request's
  first token then comes one step after it arrives, sooner than any P/D
  path's (a prefill step, a transfer, then a step here), the history's
  blocks are cache hits, and the running streams' token gaps stay within
  the budget by construction. While the pod's step-time model is still
  learning, what fits one probe step (`PROBE_TOKENS`) beside the last
  step's rows qualifies. A pod without a budget never takes this rule:
  nothing bounds what the prompt would cost its streams.

  One step, not several: a rule that also took prompts the pod finishes
  over several budgeted steps sooner than the prefill pod would (by the
  pod's step-time model) was measured worse on two cores: on an idle pod
  the chunks ran uncapped until streams joined, which stretched their
  token gaps, and later chunks, capped, took longer than predicted
  (docs/routing.md, "Next turns on the decode pod").

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

    def asks(self, scheduler: Scheduler) -> bool:
        """Whether a rule could hold on this pod, so its cached prefix is
        worth looking up (the within-budget rule needs an ITL budget)."""
        return bool(self.below) or (self.beyond is not None
                                    and scheduler.itl_budget is not None)

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
        if scheduler.has_prompt_work:
            return False  # this one would wait behind it
        cap = scheduler.mixed_prefill_tokens
        if cap and new > cap:
            return False
        fits = budget.fits_next_step(cached, new)
        if fits is None:  # the step-time model is still learning: one probe step at most
            return new <= PROBE_TOKENS and budget.fits_beside_last_step(cached, new)
        return fits

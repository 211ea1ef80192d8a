"""`ItlBudget`: prompt work on a pod that decodes is admitted into a step only
while the step's predicted time stays within an inter-token budget.

Why: every decoding request waits for the whole step, so a step that also
computes prompt tokens (a local prefill, the idle side, a split prompt's
tail, a queued prompt's chunk) stretches every running stream's gap between
two tokens. Disaggregation exists to keep that gap short; the budget bounds
it by construction instead of by a fixed token count, which is too many on
a slow device and too few on a fast one.

The step-time model (`StepTimeModel`) is learnt on the pod from its own
steps: a step's time is fitted as

    t = c0 + c_rows * rows + c_tokens * tokens + c_context * context / 1000

(rows: sequences in the step; tokens: tokens computed; context: the sum over
rows of the context each attends to), by least squares with a small ridge
over the last `WINDOW` steps, refitted every `REFIT_EVERY` steps, negative
coefficients dropped (a step never gets cheaper with more work). It needs
steps with and without prompt tokens (`ready`); before, a step that decodes
takes at most `PROBE_TOKENS` prompt tokens, so the model learns what a
prompt token costs.

The budget: `--itl-budget-ms`: `off`, a number of milliseconds, or `auto`
(the decode pod's default): `AUTO_FACTOR` times the pod's own plain decode
step at the step's batch and context, as the model predicts it. For a step
with D decoding rows, each prompt row computes the most tokens P with
predict(step + that row) <= budget; 0 means the prompt
waits (it runs once the budget allows or no sequence decodes). A step with
nothing to decode is not capped: no stream waits for it.

Threads: `observe` is called by the step pipeline on the engine loop
thread when a step completes, `room` by the scheduler on the same
thread; `snapshot` from any thread (a tuple swap).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

WINDOW = 256
REFIT_EVERY = 8
MIN_PLAIN_STEPS = 16  # steps without prompt tokens before the model is trusted
MIN_PROMPT_STEPS = 4  # ... and steps with some
PROBE_TOKENS = 64  # prompt tokens per decoding step while the model learns
AUTO_FACTOR = 1.5  # auto budget: this times the plain decode step
RIDGE = 1e-6
FEATURES = ("step", "rows", "tokens", "context")


@dataclass(frozen=True, slots=True)
class StepFeatures:
    rows: int
    tokens: int
    context: int  # sum over rows of the tokens each row attends to

    def vector(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.rows), float(self.tokens), self.context / 1000.0)

    @staticmethod
    def of(scheduled: Sequence) -> StepFeatures:
        """From a plan's `ScheduledRequest`s (engine/scheduler.py)."""
        return StepFeatures(rows=len(scheduled),
                            tokens=sum(s.num_new_tokens for s in scheduled),
                            context=sum(s.start + s.num_new_tokens for s in scheduled))


def parse_budget(text: str) -> float | None:
    """'off' -> None, 'auto' -> 0.0 (auto), '25' -> 25.0 ms; ValueError otherwise."""
    value = text.strip().lower()
    if value == "off":
        return None
    if value == "auto":
        return 0.0
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not 0 < ms <= 60_000:
        raise ValueError(f"itl budget must be 'off', 'auto' or milliseconds in (0, 60000], "
                         f"got {text!r}")
    return ms


class StepTimeModel:
    def __init__(self) -> None:
        self._samples: deque[tuple[tuple[float, ...], float, bool]] = deque(maxlen=WINDOW)
        self._since_fit = 0
        self.coefficients: tuple[float, ...] | None = None  # FEATURES order, seconds

    @property
    def ready(self) -> bool:
        return self.coefficients is not None

    def observe(self, features: StepFeatures, seconds: float) -> None:
        prompt = features.tokens > features.rows
        self._samples.append((features.vector(), seconds, prompt))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            self._fit()

    def _fit(self) -> None:
        with_prompt = sum(1 for *_, p in self._samples if p)
        if with_prompt < MIN_PROMPT_STEPS or len(self._samples) - with_prompt < MIN_PLAIN_STEPS:
            return
        x = torch.tensor([s[0] for s in self._samples], dtype=torch.float64)
        y = torch.tensor([s[1] for s in self._samples], dtype=torch.float64)
        keep = list(range(len(FEATURES)))
        while True:  # least squares; drop a negative coefficient and refit
            xs = x[:, keep]
            gram = xs.T @ xs + RIDGE * torch.eye(len(keep), dtype=torch.float64)
            solution = torch.linalg.solve(gram, xs.T @ y).tolist()
            negative = [k for k, c in zip(keep, solution, strict=True) if c < 0]
            if not negative:
                break
            keep.remove(negative[0])
        coefficients = [0.0] * len(FEATURES)
        for k, c in zip(keep, solution, strict=True):
            coefficients[k] = c
        self.coefficients = tuple(coefficients)

    def predict(self, features: StepFeatures) -> float:
        assert self.coefficients is not None
        return sum(c * v for c, v in zip(self.coefficients, features.vector(), strict=True))


class PromptRoom:
    """One step's room for prompt rows beside its decoding rows: `take(start,
    wanted)` is how many of `wanted` prompt tokens from context position
    `start` fit (0: none), counted into the step. Without a ready model, a
    fixed number of probe tokens in all."""

    def __init__(self, model: StepTimeModel | None, step: StepFeatures, limit_s: float,
                 probe_tokens: int | None) -> None:
        self._model = model
        self._step = step
        self._limit_s = limit_s
        self._probe = probe_tokens
        self.cut = False  # some prompt work did not fit

    def take(self, start: int, wanted: int, *, whole: bool = False) -> int:
        """`whole`: all `wanted` tokens or none (a short prompt, admitted whole)."""
        n = min(wanted, self._probe) if self._model is None else self._fit(start, wanted)
        self.cut = self.cut or n < wanted
        if whole and n < wanted:
            return 0
        if self._model is None:
            self._probe -= n
        if n:
            self._step = StepFeatures(self._step.rows + 1, self._step.tokens + n,
                                      self._step.context + start + n)
        return n

    def _fit(self, start: int, wanted: int) -> int:
        """The most n <= wanted with predict(step + a row of n tokens from `start`) <= limit."""
        _, c_rows, c_tokens, c_context = self._model.coefficients
        left = (self._limit_s - self._model.predict(self._step) - c_rows
                - c_context * (start / 1000.0))
        per_token = c_tokens + c_context / 1000.0
        if left < 0:
            return 0
        if per_token <= 0:
            return wanted
        return min(wanted, math.floor(left / per_token * (1 - 1e-12)))


class ItlBudget:
    """`budget_ms`: a fixed budget, or 0.0 for auto (`parse_budget`)."""

    @staticmethod
    def of(setting: str) -> ItlBudget | None:
        """The budget `EngineConfig.itl_budget` names; None when off."""
        budget_ms = parse_budget(setting)
        return None if budget_ms is None else ItlBudget(budget_ms)

    def __init__(self, budget_ms: float, model: StepTimeModel | None = None) -> None:
        self.budget_ms = budget_ms
        self.model = model or StepTimeModel()
        self.capped_steps = 0  # steps whose prompt tokens the budget cut
        self.last_decoding: StepFeatures | None = None  # the last plan's decoding rows

    def observe(self, scheduled: Sequence, seconds: float) -> None:
        if scheduled:
            self.model.observe(StepFeatures.of(scheduled), seconds)

    def budget_s(self, decoding: StepFeatures) -> float:
        if self.budget_ms > 0:
            return self.budget_ms / 1000.0
        return AUTO_FACTOR * self.model.predict(decoding)

    def room(self, decoding: Sequence) -> PromptRoom | None:
        """What prompt work the step may add to the `decoding` rows already in
        it; None: no limit (nothing decodes)."""
        plain = self.last_decoding = StepFeatures.of(decoding) if decoding else None
        return None if plain is None else self._room(plain)

    def _room(self, plain: StepFeatures) -> PromptRoom:
        if not self.model.ready:
            return PromptRoom(None, plain, 0.0, PROBE_TOKENS)
        return PromptRoom(self.model, plain, self.budget_s(plain), None)

    def fits_beside_last_step(self, start: int, num_tokens: int) -> bool:
        """Would `num_tokens` prompt tokens from `start` fit beside the last
        planned step's decoding rows (True when it decoded nothing)? Any
        thread: it reads the last plan's features, replaced whole."""
        plain = self.last_decoding
        return plain is None or self._room(plain).take(start, num_tokens, whole=True) > 0

    def fits_next_step(self, start: int, num_tokens: int) -> bool | None:
        """Would `num_tokens` prompt tokens from `start` fit one step beside
        the last plan's decoding rows, or, when it decoded nothing, beside
        one decoding row (a stream may join before that step ends, and an
        idle pod's step is not capped)? None while the model is not ready.
        Any thread (it reads the last plan's features, replaced whole)."""
        if not self.model.ready:
            return None
        plain = self.last_decoding or StepFeatures(1, 1, start)
        return self._room(plain).take(start, num_tokens, whole=True) > 0

    def count_capped(self) -> None:
        self.capped_steps += 1

    def snapshot(self) -> dict[str, float]:
        """For the pod's gauges: the model's coefficients, seconds per unit of
        each term (0 until the model is ready)."""
        coefficients = self.model.coefficients or (0.0,) * len(FEATURES)
        return dict(zip(FEATURES, coefficients, strict=True))

"""The inter-token budget: the step-time model learns a pod's steps from
fresh random observations, and a scheduler with a budget never plans a
step that decodes whose predicted time exceeds it, while a long prompt
still completes (plan tests)."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.itl_budget import (
    AUTO_FACTOR,
    PROBE_TOKENS,
    ItlBudget,
    StepFeatures,
    StepTimeModel,
    parse_budget,
)
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler

TRUE = (0.004, 0.0005, 0.0002, 0.0008)  # per step, row, token, 1000 context tokens


def _seconds(features: StepFeatures, rng: random.Random, noise: float = 0.02) -> float:
    exact = sum(c * v for c, v in zip(TRUE, features.vector(), strict=True))
    return exact * (1 + rng.uniform(-noise, noise))


def _random_step(rng: random.Random) -> StepFeatures:
    rows = rng.randint(1, 32)
    prompt = rng.choice([0, 0, 0, rng.randint(16, 512)])
    return StepFeatures(rows=rows + (1 if prompt else 0), tokens=rows + prompt,
                        context=rows * rng.randint(50, 2000) + prompt)


def test_the_model_learns_step_times_from_the_pods_own_steps() -> None:
    rng = random.Random(1234)
    model = StepTimeModel()
    for _ in range(300):
        features = _random_step(rng)
        model.observe(features, _seconds(features, rng))
    assert model.ready
    for _ in range(50):  # fresh shapes, never observed
        features = _random_step(rng)
        assert model.predict(features) == pytest.approx(_seconds(features, rng, 0), rel=0.05)


def test_the_model_waits_for_steps_with_and_without_prompt_tokens() -> None:
    model = StepTimeModel()
    for _ in range(100):  # decode only: what a prompt token costs is unknown
        model.observe(StepFeatures(8, 8, 4000), 0.03)
    assert not model.ready
    budget = ItlBudget(0.0, model)
    decoding = [ScheduledRequest(None, 100, 1, True)]
    room = budget.room(decoding)  # a probe chunk to learn from, in all
    assert room.take(0, 1000) == PROBE_TOKENS and room.take(0, 10) == 0 and room.cut
    assert budget.room([]) is None  # nothing decodes: no limit


def _known(budget_ms: float) -> ItlBudget:
    model = StepTimeModel()
    model.coefficients = TRUE
    return ItlBudget(budget_ms, model)


def _predicted(budget: ItlBudget, scheduled) -> float:
    return budget.model.predict(StepFeatures.of(scheduled))


def _finish(sched: Scheduler, out) -> None:
    sched.update_computed(out)
    for s in out.scheduled:
        if s.end == s.request.num_tokens:
            s.request.append_output_token(7)
            s.request.num_output_placeholders = 0


@pytest.mark.parametrize("budget_ms", [0.0, 12.0], ids=["auto", "12ms"])
def test_a_long_prompt_beside_a_decode_batch_comes_in_chunks_that_fit(budget_ms: float) -> None:
    budget = _known(budget_ms)
    sched = Scheduler(BlockManager(4096, 16, enable_prefix_caching=False), max_num_seqs=16,
                      max_num_batched_tokens=2048, itl_budget=budget)
    decoders = [Request(f"d{i}", range(100 * i, 100 * i + 300), SamplingParams(max_tokens=40))
                for i in range(8)]
    for r in decoders:
        sched.add(r)
    _finish(sched, sched.schedule())  # their prompts: nothing decodes yet, no cap
    prompt = Request("p", range(5000, 7000), SamplingParams(max_tokens=4))
    sched.add(prompt)
    chunks = []
    for _ in range(400):
        out = sched.schedule()
        decoding = [s for s in out.scheduled if s.request is not prompt]
        if decoding:
            limit = budget.budget_s(StepFeatures.of(decoding))
            assert _predicted(budget, out.scheduled) <= limit + 1e-9
        chunks += [s.num_new_tokens for s in out.scheduled if s.request is prompt]
        _finish(sched, out)
        for r in decoders:
            if r.status is RequestStatus.RUNNING and r.num_output_tokens >= 40:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        if prompt.num_computed_tokens >= prompt.num_prompt_tokens:
            break
    assert prompt.num_computed_tokens == prompt.num_prompt_tokens  # it completed
    assert len(chunks) > 3 and max(chunks[:-1]) < 2000  # in chunks, not in one step
    assert budget.capped_steps > 0


def test_a_budget_below_a_plain_step_holds_prompts_until_nothing_decodes() -> None:
    budget = _known(1.0)  # 1 ms: below any step that decodes
    sched = Scheduler(BlockManager(256, 16, enable_prefix_caching=False), max_num_seqs=8,
                      max_num_batched_tokens=512, itl_budget=budget)
    d = Request("d", range(50), SamplingParams(max_tokens=3))
    sched.add(d)
    _finish(sched, sched.schedule())
    p = Request("p", range(100, 200), SamplingParams())
    sched.add(p)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["d"]  # p waits
    _finish(sched, out)
    sched.finish(d, RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("p", 100)]


def test_auto_is_a_factor_of_the_plain_step_and_the_setting_is_checked() -> None:
    budget = _known(0.0)
    plain = StepFeatures(8, 8, 8 * 500)
    assert budget.budget_s(plain) == pytest.approx(AUTO_FACTOR * budget.model.predict(plain))
    assert parse_budget("off") is None and parse_budget("auto") == 0.0
    assert parse_budget("25") == 25.0
    for bad in ("0", "-3", "fast", "70000"):
        with pytest.raises(ValueError, match="itl budget must be 'off', 'auto' or milli"):
            parse_budget(bad)
    with pytest.raises(ValueError, match="itl budget"):
        EngineConfig(model_dir="/m", itl_budget="soon")

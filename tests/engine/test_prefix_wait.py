"""Waiting for a prefix in flight (engine/prefix_wait.py, used by
engine/scheduler.py): a request whose next uncached prompt block another
running request is computing waits for it instead of computing it twice;
it proceeds when that request is aborted or the wait times out; requests
that share no prefix keep their order. Plans on a real `BlockManager`, and
the engine's outputs against the no-cache reference."""

from __future__ import annotations

import time

import pytest

from engine.block_manager import BlockManager
from engine.reference import reference_greedy
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from tests.engine.test_llm_engine import _prompts

pytestmark = pytest.mark.timeout(120)

BLOCK = 4
SHARED = list(range(100, 100 + 3 * BLOCK))  # a 3-block prefix


def _sched(**kwargs) -> Scheduler:
    bm = BlockManager(32, BLOCK, enable_prefix_caching=True)
    return Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, **kwargs)


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4))


def _plan(out) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def _complete(sched: Scheduler, out) -> None:
    """The step's forward pass is done: its KV is cached, its tokens sampled."""
    sched.update_computed(out)
    for s in out.scheduled:
        if s.samples:
            s.request.num_output_placeholders -= 1
            s.request.append_output_token(7)


def _first_in_flight(sched: Scheduler):
    """`a` (the shared prefix + 2 tokens) scheduled, its step not complete."""
    a = _req("a", SHARED + [1, 2])
    sched.add(a)
    out = sched.schedule()
    assert _plan(out) == [("a", 0, 14)]
    return a, out


def test_the_second_request_waits_and_computes_only_its_tail():
    sched = _sched()
    a, step0 = _first_in_flight(sched)
    b = _req("b", SHARED + [3, 4, 5])
    sched.add(b)
    step1 = sched.schedule()  # a's 3 blocks are still being computed
    assert _plan(step1) == [("a", 14, 1)]
    assert b.status is RequestStatus.WAITING and b.block_ids == []
    assert sched.prefix_wait.num_waits == 1
    _complete(sched, step0)
    step2 = sched.schedule()
    assert ("b", 12, 3) in _plan(step2)
    assert b.num_cached_tokens == 12
    assert sched.prefix_wait.num_waits == 1  # counted once per request


def test_without_the_rule_the_prefix_is_computed_twice():
    sched = _sched(prefix_wait_s=0)
    _, _ = _first_in_flight(sched)
    sched.add(_req("b", SHARED + [3, 4, 5]))
    assert _plan(sched.schedule()) == [("a", 14, 1), ("b", 0, 15)]
    assert sched.prefix_wait.num_waits == 0


def test_the_first_aborted_mid_prefill_the_second_computes_everything():
    sched = _sched()
    a, step0 = _first_in_flight(sched)
    b = _req("b", SHARED + [3, 4, 5])
    sched.add(b)
    assert _plan(sched.schedule()) == [("a", 14, 1)]
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    sched.update_computed(step0)  # a's blocks never enter the cache
    assert _plan(sched.schedule()) == [("b", 0, 15)]
    assert b.num_cached_tokens == 0


def test_requests_that_share_no_prefix_keep_their_order():
    sched = _sched()
    _first_in_flight(sched)
    for rid, prompt in (("b", SHARED + [3]), ("c", [900, 901, 902]), ("d", [950, 951])):
        sched.add(_req(rid, prompt))
    # b waits for a's blocks; c and d are admitted in their order
    assert _plan(sched.schedule()) == [("a", 14, 1), ("c", 0, 3), ("d", 0, 2)]


def test_the_wait_is_bounded():
    sched = _sched(prefix_wait_s=0.001)
    _first_in_flight(sched)
    sched.add(_req("b", SHARED + [3]))
    assert _plan(sched.schedule()) == [("a", 14, 1)]
    time.sleep(0.01)
    assert ("b", 0, 13) in _plan(sched.schedule())
    with pytest.raises(ValueError, match="max_wait_s must be >= 0"):
        _sched(prefix_wait_s=-1)


def test_outputs_equal_running_each_request_alone(make_engine, reference_model):
    """Chunked prefill (32 tokens a step): `b` arrives after `a`'s first
    chunk (2 blocks), waits while `a` computes the third shared block beside
    it, and reports all three shared blocks as cached (without the wait: 2);
    both outputs equal the reference's."""
    engine = make_engine(block_size=16, max_num_batched_tokens=32, async_scheduling=False)
    (shared,) = _prompts([50], seed=3)
    first, second = shared + [11, 12], shared + [13, 14, 15]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    engine.add_request("a", first, greedy)
    outputs = engine.step()
    engine.add_request("b", second, greedy)
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    eos = tuple(engine.eos_token_ids)
    for rid, prompt in (("a", first), ("b", second)):
        mine = [o for o in outputs if o.request_id == rid]
        assert [t for o in mine for t in o.new_token_ids] == reference_greedy(
            reference_model, prompt, 6, eos), rid
    assert [o.num_cached_tokens for o in outputs if o.request_id == "b"][0] == 48
    assert engine.scheduler.prefix_wait.num_waits == 1

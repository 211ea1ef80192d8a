import time

import pytest

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

S = RequestStatus


def _sched(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, caching=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def _req(rid, n, start=0):
    return Request(rid, range(start, start + n), SamplingParams())


def _plan(out):
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def _finish_step(sched, out, sample_token=1):
    """What the engine does after the forward: advance, append a sampled token."""
    sched.update_computed(out)
    for s in out.scheduled:
        if s.end == s.request.num_tokens:
            s.request.append_output_token(sample_token)


def test_prefill_then_decode_mixed_with_new_prefill():
    sched = _sched()
    a = _req("a", 5)
    sched.add(a)
    out = sched.schedule()
    assert _plan(out) == [("a", 0, 5)] and a.status is S.RUNNING
    _finish_step(sched, out)
    sched.add(_req("b", 3, start=100))
    out = sched.schedule()
    assert _plan(out) == [("a", 5, 1), ("b", 0, 3)]
    assert out.num_batched_tokens == 4


def test_chunked_prefill_over_budget():
    sched = _sched(budget=4)
    a, b = _req("a", 10), _req("b", 2, start=50)
    sched.add(a)
    sched.add(b)
    plans = []
    for _ in range(4):
        out = sched.schedule()
        plans.append(_plan(out))
        _finish_step(sched, out)
    assert plans == [
        [("a", 0, 4)],
        [("a", 4, 4)],
        [("a", 8, 2), ("b", 0, 2)],
        [("a", 10, 1), ("b", 2, 1)],
    ]


def test_max_num_seqs_limits_admission():
    sched = _sched(max_num_seqs=2)
    for i in range(3):
        sched.add(_req(f"r{i}", 2, start=10 * i))
    assert [s[0] for s in _plan(sched.schedule())] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_preemption_frees_newest_and_requeues_at_head():
    # 4 blocks of 4 slots: two requests of 7 tokens fill them; decoding needs more.
    sched = _sched(num_blocks=4)
    a, b = _req("a", 8), _req("b", 8, start=50)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert _plan(out) == [("a", 0, 8), ("b", 0, 8)]
    first_b = time.monotonic()
    _finish_step(sched, out)
    assert sched.block_manager.num_free_blocks == 0
    out = sched.schedule()
    assert out.preempted_request_ids == ("b",)
    assert _plan(out) == [("a", 8, 1)]
    assert b.status is S.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b]
    _finish_step(sched, out)
    sched.finish(a, S.FINISHED_STOPPED)
    # b resumes: prompt + its sampled token (9 tokens) are context now. b freed
    # its blocks last-first, so a's new block evicted b's second block; the
    # first is still cached and reused.
    out = sched.schedule()
    assert _plan(out) == [("b", 4, 5)]
    assert b.num_cached_tokens == 0  # the hit statistic is from its first schedule only
    assert b.status is S.RUNNING
    # a trace's phases: preempted once; its queue wait ended at its first schedule
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert b.first_scheduled_at is not None and b.first_scheduled_at < first_b


def test_the_first_schedule_is_stamped_once():
    sched = _sched()
    a = _req("a", 8)
    sched.add(a)
    assert a.first_scheduled_at is None
    before = time.monotonic()
    out = sched.schedule()
    assert before <= a.first_scheduled_at <= time.monotonic()
    stamped = a.first_scheduled_at
    _finish_step(sched, out)
    sched.schedule()
    assert a.first_scheduled_at == stamped


def test_running_request_preempts_itself_when_last():
    sched = _sched(num_blocks=2)
    a = _req("a", 8)
    sched.add(a)
    out = sched.schedule()
    _finish_step(sched, out)
    out = sched.schedule()
    assert out.preempted_request_ids == ("a",) and out.scheduled == ()


def test_prefix_hit_counts_cached_tokens_and_finish_frees_everything():
    sched = _sched()
    a = _req("a", 9)
    sched.add(a)
    _finish_step(sched, sched.schedule())
    b = Request("b", [*range(8), 77, 78], SamplingParams())
    sched.add(b)
    out = sched.schedule()
    assert _plan(out) == [("a", 9, 1), ("b", 8, 2)]
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    _finish_step(sched, out)
    for r in (a, b):
        sched.finish(r, S.FINISHED_STOPPED)
    assert sched.block_manager.num_free_blocks == 16 and sched.running == []


@pytest.mark.parametrize("state", ["waiting", "running", "reserved"])
def test_finish_in_any_state_leaves_queues_and_frees(state):
    sched = _sched()
    r = _req("r", 6)
    if state == "reserved":
        r = Request("r", range(6), SamplingParams(), status=S.WAITING_FOR_REMOTE_KV)
        sched.block_manager.allocate_slots(r, 6)
        sched.add_reserved(r)
    else:
        sched.add(r)
        if state == "running":
            _finish_step(sched, sched.schedule())
    assert sched.block_manager.num_free_blocks == (16 if state == "waiting" else 14)
    sched.finish(r, S.FINISHED_ABORTED)
    assert not sched.waiting and not sched.running and not sched.reserved
    assert sched.block_manager.num_free_blocks == 16


def test_reserved_requests_are_skipped_until_committed():
    sched = _sched(max_num_seqs=2)
    r = Request("r", range(6), SamplingParams(), status=S.WAITING_FOR_REMOTE_KV)
    sched.block_manager.allocate_slots(r, 6 + 4)
    sched.add_reserved(r)
    sched.add(_req("x", 2, start=40))
    sched.add(_req("y", 2, start=60))
    out = sched.schedule()
    assert _plan(out) == [("x", 0, 2)]  # r holds a batch slot, y must wait
    _finish_step(sched, out)
    r.num_computed_tokens = 6
    r.append_output_token(5)
    sched.commit_reserved(r)
    assert r.status is S.RUNNING
    assert _plan(sched.schedule()) == [("x", 2, 1), ("r", 6, 1)]


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-first", "fcfs"])
def test_a_long_prompt_mixed_into_a_decode_batch_never_exceeds_the_budget(decode_first):
    """Four requests are decoding when a 40-token prompt arrives: every step
    stays within the budget, every decoding request gets its token in every
    step, and the prompt is prefilled in chunks from what is left."""
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6, decode_first=decode_first)
    shorts = [_req(f"s{i}", 2, start=10 * i) for i in range(4)]
    for r in shorts:
        sched.add(r)
    out = sched.schedule()
    assert _plan(out) == [("s0", 0, 2), ("s1", 0, 2), ("s2", 0, 2)]
    _finish_step(sched, out)
    long = _req("long", 40, start=500)
    sched.add(long)
    chunks = []
    for _ in range(12):
        out = sched.schedule()
        plan = _plan(out)
        assert out.num_batched_tokens <= 6, plan
        decoding = [r for r in shorts[:3] if r.status is S.RUNNING]
        assert [p for p in plan if p[0] in {"s0", "s1", "s2"}] == [
            (r.request_id, r.num_tokens - 1, 1) for r in decoding]
        chunks += [n for name, _, n in plan if name == "long"]
        _finish_step(sched, out)
    # first step: 3 decode tokens + s3's 2-token prompt leave 1 token for the
    # long prompt; then 4 decode tokens leave it 2 per step
    assert chunks == [1] + [2] * 11


def test_decode_first_orders_decoding_before_prefilling_requests():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    for decode_first, expected in ((True, ["d", "p"]), (False, ["p", "d"])):
        sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64,
                          decode_first=decode_first)
        p, d = _req("p", 9), _req("d", 1, start=40)
        p.transition(S.RUNNING)
        d.transition(S.RUNNING)
        p.num_computed_tokens = 4   # mid-prefill
        d.num_computed_tokens = 0   # one token to compute: decoding
        sched.running.extend([p, d])  # p is older
        assert [s.request.request_id for s in sched.schedule().scheduled] == expected
        for r in (p, d):
            bm.free(r)


def test_preemption_under_decode_first_never_takes_a_request_already_in_the_step():
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _req("a", 8), _req("b", 12, start=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    _finish_step(sched, out)
    # a: 8 + 1 tokens in 3 blocks, b: 12 + 1 in 4: 7 > 6. a (older, first in
    # the step) keeps its block; the victim is b itself, the newest request
    # not yet in this step.
    out = sched.schedule()
    assert _plan(out) == [("a", 8, 1)] and out.preempted_request_ids == ("b",)
    assert b.status is S.PREEMPTED and sched.waiting[0] is b


def test_blocks_of_a_request_freed_while_its_step_is_in_flight_return_when_it_completes():
    """Async scheduling: finishing or preempting a request whose step has not
    completed defers its blocks; nothing can allocate them until then."""
    sched = _sched(num_blocks=4)
    a, b = _req("a", 6), _req("b", 6, start=50)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # in flight: a and b write blocks 0-1 and 2-3
    assert sched.block_manager.num_free_blocks == 0
    sched.finish(a, S.FINISHED_ABORTED)
    assert a.block_ids == [] and sched.block_manager.num_free_blocks == 0
    assert sched.num_deferred_blocks == 2
    # b's next token (a placeholder) needs no new block: b is planned before
    # the first step completed, and nobody can take a's blocks meanwhile.
    second = sched.schedule()
    assert _plan(second) == [("b", 6, 1)] and b.num_output_placeholders == 2
    assert sched.block_manager.num_free_blocks == 0
    sched.update_computed(first)
    assert sched.block_manager.num_free_blocks == 2 and sched.num_deferred_blocks == 0


def test_a_request_waits_for_deferred_blocks_instead_of_preempting():
    sched = _sched(num_blocks=3)
    a, b = _req("a", 4), _req("b", 8, start=50)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # a: block 0, b: blocks 1-2, none free
    sched.finish(a, S.FINISHED_STOPPED)  # a's block comes back when `first` completes
    # b's placeholder (token 8) needs a third block: only a's deferred block
    # would do, so b waits a step instead of preempting itself.
    second = sched.schedule()
    assert second.scheduled == () and second.preempted_request_ids == ()
    assert b.status is S.RUNNING and sched.num_preemptions == 0
    sched.update_computed(first)
    assert _plan(sched.schedule()) == [("b", 8, 1)] and b.block_ids == [1, 2, 0]


def _short_sched(short=4, budget=8, num_blocks=32, block_size=4):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    return Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget,
                     short_prefill_tokens=short)


def test_short_prompts_go_before_longer_prompts_chunks_within_half_the_budget():
    sched = _short_sched(short=4, budget=8)
    long_a, long_b = _req("long-a", 20), _req("long-b", 20, start=100)
    sched.add(long_a)
    sched.add(long_b)
    out = sched.schedule()
    assert _plan(out) == [("long-a", 0, 8)]
    _finish_step(sched, out)
    shorts = [_req("s1", 3, start=200), _req("s2", 3, start=300), _req("s3", 2, start=400)]
    for r in shorts:
        sched.add(r)
    out = sched.schedule()
    # half the budget is 4 tokens: s1 (3) fits, s2 (3) and s3 (2) do not;
    # long-a's chunk takes the rest, long-b waits
    assert _plan(out) == [("s1", 0, 3), ("long-a", 8, 5)]
    _finish_step(sched, out)
    out = sched.schedule()
    assert _plan(out)[0] == ("s1", 3, 1)  # decoding first
    assert ("s2", 0, 3) in _plan(out)
    # without the option the short ones wait behind both long prompts
    fcfs = _short_sched(short=0, budget=8)
    for r in (_req("long-a", 20), _req("long-b", 20, start=100)):
        fcfs.add(r)
    _finish_step(fcfs, fcfs.schedule())
    fcfs.add(_req("s1", 3, start=200))
    assert [p[0] for p in _plan(fcfs.schedule())] == ["long-a"]


def test_a_cached_history_counts_as_short_and_keeps_its_prefix():
    sched = _short_sched(short=4, budget=16)
    first = _req("turn-1", 12, start=500)
    sched.add(first)
    out = sched.schedule()
    _finish_step(sched, out)
    sched.finish(first, S.FINISHED_STOPPED)
    busy = _req("busy", 40, start=900)
    sched.add(busy)
    _finish_step(sched, sched.schedule())
    # the next turn: the first turn's 12 tokens (3 full blocks, cached) and
    # 2 new ones: 2 to compute, under the short limit though 14 are not
    turn = Request("turn-2", list(range(500, 512)) + [7, 8], SamplingParams())
    sched.add(turn)
    out = sched.schedule()
    plan = _plan(out)
    assert plan[0] == ("turn-2", 12, 2) and turn.num_cached_tokens == 12
    assert plan[1][0] == "busy"


def test_short_prefill_tokens_is_checked():
    with pytest.raises(ValueError, match="short_prefill_tokens must be in"):
        from engine.config import EngineConfig
        EngineConfig(model_dir="m", short_prefill_tokens=5000)


def _mixed_sched(mixed, budget=16, short=0):
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    return Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget,
                     short_prefill_tokens=short, mixed_prefill_tokens=mixed)


def test_a_step_that_decodes_computes_at_most_mixed_prefill_tokens_of_prompts():
    sched = _mixed_sched(mixed=4, budget=16)
    a = _req("a", 3)
    sched.add(a)
    out = sched.schedule()
    assert _plan(out) == [("a", 0, 3)]  # nothing decodes: the whole budget
    _finish_step(sched, out)
    long_b, short_c = _req("b", 10, start=100), _req("c", 3, start=200)
    sched.add(long_b)
    sched.add(short_c)
    out = sched.schedule()
    # a decodes, so prompts get 4 tokens: b's first chunk, c waits
    assert _plan(out) == [("a", 3, 1), ("b", 0, 4)]
    _finish_step(sched, out)
    out = sched.schedule()
    # b's next chunk and c's admission share the 4
    assert _plan(out) == [("a", 4, 1), ("b", 4, 4)]
    _finish_step(sched, out)
    sched.finish(a, S.FINISHED_STOPPED)
    out = sched.schedule()
    # nothing decodes: the rest of b and all of c in one step
    assert _plan(out) == [("b", 8, 2), ("c", 0, 3)]


def test_mixed_prefill_tokens_leaves_every_decode_in_the_step():
    sched = _mixed_sched(mixed=2, budget=16)
    decoders = [_req(f"d{i}", 1, start=10 * i) for i in range(6)]
    for r in decoders:
        sched.add(r)
    _finish_step(sched, sched.schedule())
    sched.add(_req("p", 8, start=500))
    plan = _plan(sched.schedule())
    assert [p[0] for p in plan] == ["d0", "d1", "d2", "d3", "d4", "d5", "p"]
    assert plan[-1] == ("p", 0, 2)
    # the same budget as a smaller max_num_batched_tokens would cap the decodes too
    capped = _sched(num_blocks=64, budget=2)
    for r in [_req(f"d{i}", 1, start=10 * i) for i in range(6)]:
        capped.add(r)
    for _ in range(3):
        _finish_step(capped, capped.schedule())
    assert len(_plan(capped.schedule())) == 2


def test_mixed_prefill_tokens_is_checked():
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match="mixed_prefill_tokens must be in"):
        EngineConfig(model_dir="m", mixed_prefill_tokens=-1)
    # above the step budget it caps nothing (a decode pod's default of 128
    # with --max-num-batched-tokens 64 is valid)
    EngineConfig(model_dir="m", max_num_batched_tokens=64, mixed_prefill_tokens=128)

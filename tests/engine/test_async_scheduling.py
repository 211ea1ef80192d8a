"""Async scheduling (step N+1 planned and launched while step N computes)
against the synchronous engine, token for token (float32, CPU, tiny model),
and the deferred release of blocks a step in flight still writes."""

from __future__ import annotations

import pytest
import torch

import kernels
from engine.errors import CapacityError
from engine.reference import reference_greedy
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(180)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1100, (n,), generator=g).tolist() for n in lengths]


def _drive(engine, requests, *, on_step=None):
    """Add (id, prompt, params) requests and step to the end. Returns every
    RequestOutput in order; `on_step(engine, step_index)` runs between steps."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    outputs, index = [], 0
    while engine.has_unfinished_requests():
        if on_step is not None:
            on_step(engine, index)
        outputs.extend(engine.step())
        index += 1
    return outputs


def _per_request(outputs):
    """id -> (tokens, logprobs, finish_reason); checks nothing follows a finish."""
    got = {}
    for out in outputs:
        tokens, logprobs, reason = got.get(out.request_id, ([], [], None))
        assert reason is None, f"{out.request_id} emitted after finishing"
        got[out.request_id] = (tokens + list(out.new_token_ids),
                               logprobs + list(out.new_logprobs), out.finish_reason)
    return got


def _both(make_engine, requests, **config):
    sync = make_engine(async_scheduling=False, **config)
    async_ = make_engine(async_scheduling=True, **config)
    expected = _per_request(_drive(sync, requests))
    got = _per_request(_drive(async_, requests))
    for engine in (sync, async_):
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.num_running == stats.num_waiting == 0
    return expected, got, async_


def test_mixed_batch_greedy_seeded_logprobs_stops_and_max_tokens(make_engine, reference_model):
    prompts = _prompts([3, 17, 40, 150, 70, 9], seed=20)
    # A stop id the greedy request samples third: it stops with a step in flight.
    eos = tuple(make_engine().eos_token_ids)
    stop_at = reference_greedy(reference_model, prompts[0], 8, eos)[2]
    requests = [
        ("stop", prompts[0], SamplingParams(temperature=0, max_tokens=8,
                                            stop_token_ids=(stop_at,), logprobs=2)),
        ("greedy", prompts[1], SamplingParams(temperature=0, max_tokens=10)),
        ("seeded", prompts[2], SamplingParams(temperature=1.0, top_p=0.9, seed=7,
                                              max_tokens=12, ignore_eos=True, logprobs=3)),
        ("topk", prompts[3], SamplingParams(temperature=0.8, top_k=40, seed=1, max_tokens=9,
                                            ignore_eos=True)),
        ("one", prompts[4], SamplingParams(temperature=0, max_tokens=1)),
        ("two", prompts[5], SamplingParams(temperature=0.5, seed=3, max_tokens=2,
                                           ignore_eos=True, logprobs=0)),
    ]
    expected, got, _ = _both(make_engine, requests, block_size=16, num_blocks=128)
    assert got == expected
    assert expected["stop"][0][-1] == stop_at and expected["stop"][2] == "stop"
    assert len(expected["stop"][0]) == 3
    assert len(expected["seeded"][0]) == 12 and len(set(expected["seeded"][0])) > 1
    assert expected["one"][2] == "length" and len(expected["one"][0]) == 1
    assert expected["greedy"][0] == reference_greedy(reference_model, prompts[1], 10, eos)


def test_chunked_prefill_and_requests_arriving_mid_pipeline(make_engine):
    prompts = _prompts([70, 5, 33, 21], seed=21)
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=7, ignore_eos=True)

    def arrive(engine, index):
        if index == 3:  # joins while the first requests' steps are in flight
            engine.add_request("late", prompts[3], params)

    sync, async_ = (make_engine(max_num_batched_tokens=16, async_scheduling=a)
                    for a in (False, True))
    initial = [(f"r{i}", p, params) for i, p in enumerate(prompts[:3])]
    expected = _per_request(_drive(sync, initial, on_step=arrive))
    got = _per_request(_drive(async_, initial, on_step=arrive))
    assert got == expected and set(got) == {"r0", "r1", "r2", "late"}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_preemption_under_a_tiny_kv_budget(make_engine, reference_model, params):
    # 6 blocks of 16 slots: three 30-token prompts growing by 12 cannot all fit.
    prompts = _prompts([30, 30, 30], seed=4)
    requests = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
    expected, got, engine = _both(make_engine, requests, num_blocks=6, block_size=16)
    assert engine.stats().num_preemptions > 0
    assert got == expected
    if params.greedy:
        for i, p in enumerate(prompts):
            assert got[f"r{i}"][0] == reference_greedy(reference_model, p, 12)


def test_abort_with_its_step_in_flight_discards_its_token(make_engine):
    prompts = _prompts([20, 35, 12], seed=22)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    requests = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
    expected = _per_request(_drive(make_engine(async_scheduling=False), requests))
    engine = make_engine(async_scheduling=True)
    in_flight = {}

    def abort(engine, index):
        if index == 4:
            request = engine._requests["r1"]
            in_flight["r1"] = request.last_step_id > engine.scheduler.last_completed_step_id
            assert engine.abort_request("r1")

    got = _per_request(_drive(engine, requests, on_step=abort))
    assert in_flight == {"r1": True}
    assert got["r1"][2] == "abort"
    # Tokens up to the abort are the synchronous ones; none came after it.
    assert got["r1"][0] == expected["r1"][0][: len(got["r1"][0])]
    assert len(got["r1"][0]) < 10
    assert got["r0"] == expected["r0"] and got["r2"] == expected["r2"]
    assert engine.stats().num_free_blocks == 64


def test_blocks_of_a_finished_or_aborted_request_wait_for_its_step(make_engine,
                                                                   reference_model):
    """Neither a new request nor a remote reservation (whose KV the decode
    pod's injector writes at once) may get a block the step in flight writes."""
    engine = make_engine(num_blocks=4, block_size=16, async_scheduling=True)
    eos = tuple(engine.eos_token_ids)
    (prompt,) = _prompts([40], seed=23)
    stop_at = reference_greedy(reference_model, prompt, 6, eos)[1]
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=6,
                                                   stop_token_ids=(stop_at,)))
    held = None
    while held is None:
        outputs = engine.step()
        if any(o.finish_reason == "stop" for o in outputs):
            held = engine.scheduler.num_deferred_blocks
    # "s" stopped at step N, but step N+1 (which computes its stop token) is
    # in flight: its 3 blocks are not back yet.
    assert held == 3 and engine.stats().num_free_blocks == 1
    with pytest.raises(CapacityError, match="needs 4 KV blocks, 1 are free"):
        engine.reserve_remote("v", list(range(10, 60)), SamplingParams(max_tokens=4))
    assert engine.has_unfinished_requests()
    assert engine.step() == []  # N+1 completes: the token it sampled for "s" is dropped
    assert engine.stats().num_free_blocks == 4 and not engine.has_unfinished_requests()
    engine.reserve_remote("v", list(range(10, 60)), SamplingParams(max_tokens=4))
    assert engine.abort_request("v")

    # Abort with a step in flight: same rule.
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=20,
                                                   ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort_request("a") and engine.stats().num_free_blocks == 1
    with pytest.raises(CapacityError):
        engine.reserve_remote("w", list(range(10, 60)), SamplingParams(max_tokens=4))
    (out,) = engine.step()
    assert out.finish_reason == "abort" and engine.stats().num_free_blocks == 4


class CaptureHook:
    """Records every span and the KV rows it points at."""

    def __init__(self):
        self.spans = []
        self.kv = {}

    def on_layer_kv(self, layer_idx, kv_cache_layer, spans):
        for span in spans:
            if layer_idx == 0:
                self.spans.append((span.request_id, span.start, span.end))
            rows = kernels.extract_kv(kv_cache_layer, span.slot_mapping).clone()
            self.kv.setdefault((span.request_id, layer_idx), []).append(rows)

    def layer(self, request_id, layer_idx):
        return torch.cat(self.kv[(request_id, layer_idx)], dim=1)


def test_prefill_only_requests_and_their_spans(make_engine):
    prompts = _prompts([75, 30, 50], seed=24)
    params = SamplingParams(temperature=0.7, seed=9, max_tokens=5)
    requests = [(f"p{i}", p, params) for i, p in enumerate(prompts)]
    runs = {}
    for mode in (False, True):
        hook = CaptureHook()
        engine = make_engine(max_num_batched_tokens=32, async_scheduling=mode,
                             layer_kv_hook=hook)
        for request_id, prompt, p in requests:
            engine.add_request(request_id, prompt, p, prefill_only=True)
        outputs = []
        while engine.has_unfinished_requests():
            outputs.extend(engine.step())
        assert engine.stats().num_free_blocks == 64
        # Each request ran its prompt only, never a decode row past its first token.
        assert engine.scheduler.num_scheduled_steps == 5  # 155 tokens in 32-token steps
        runs[mode] = (_per_request(outputs), sorted(hook.spans), hook)
        # The blocks stayed in the prefix cache: 4 full blocks of the 75 tokens.
        again = _drive(engine, [("again", prompts[0], params)])
        assert again[0].num_cached_tokens == 64
    (sync_out, sync_spans, sync_hook), (async_out, async_spans, async_hook) = runs[False], \
        runs[True]
    assert async_out == sync_out
    assert all(reason == "prefill_done" and len(tokens) == 1
               for tokens, _, reason in async_out.values())
    assert async_spans == sync_spans
    for i, p in enumerate(prompts):  # spans cover [0, len) exactly once, same KV
        covered = sorted((s, e) for rid, s, e in async_spans if rid == f"p{i}")
        assert covered[0][0] == 0 and covered[-1][1] == len(p)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
        for layer in (0, 1):
            torch.testing.assert_close(async_hook.layer(f"p{i}", layer),
                                       sync_hook.layer(f"p{i}", layer), atol=0, rtol=0)


def test_remote_reservation_committed_between_steps(make_engine):
    """Decode pod: while a colocated request's step is in flight, a
    reservation is made, filled and committed; both continue like sync."""
    prompt, other = _prompts([75, 25], seed=25)
    params = SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=10,
                            ignore_eos=True)
    hook = CaptureHook()
    prefill = make_engine(layer_kv_hook=hook, async_scheduling=True)
    prefill.add_request("q", prompt, params, prefill_only=True)
    outputs = []
    while prefill.has_unfinished_requests():
        outputs.extend(prefill.step())
    (first,) = [t for o in outputs for t in o.new_token_ids]

    def decode(async_scheduling):
        engine = make_engine(block_size=128, num_blocks=8, enable_prefix_caching=False,
                             async_scheduling=async_scheduling)
        engine.add_request("o", other, params)

        def reserve_and_commit(engine, index):
            if index == 2:
                reservation = engine.reserve_remote("q", prompt, params)
                for layer, cache in enumerate(engine.kv_caches):
                    kernels.inject_kv(cache, hook.layer("q", layer), reservation.slot_mapping)
                engine.commit_remote("q", first)

        got = _per_request(_drive(engine, [], on_step=reserve_and_commit))
        assert engine.stats().num_free_blocks == 8
        return got

    sync, async_ = decode(False), decode(True)
    assert async_ == sync and len(sync["q"][0]) == 9 and len(sync["o"][0]) == 10
    colocated = make_engine(async_scheduling=False)
    assert _per_request(_drive(colocated, [("q", prompt, params)]))["q"][0] == [
        first, *sync["q"][0]]

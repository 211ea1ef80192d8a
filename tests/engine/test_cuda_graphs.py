"""The CPU-testable parts of decode CUDA graphs: bucket choice, when an engine
runs eagerly, and padding (a padded decode batch -- the work a replay does,
run eagerly on CPU -- computes exactly what the unpadded batch computes and
writes no cache slot of its own)."""

from __future__ import annotations

import pytest
import torch

from engine.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    DecodeGraphs,
    bucket_for,
    capture_sizes,
    eager_reason,
)
from engine.sampling_params import SamplingParams
from kernels import Backend, cuda_graph_unsupported_reason

pytestmark = pytest.mark.timeout(120)


def test_capture_sizes():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    sizes = capture_sizes(1024)
    assert sizes[-1] == MAX_CAPTURE_SIZE == 512
    assert sizes[sizes.index(256) + 1] == 288 and len(sizes) == 3 + 32 + 8
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        capture_sizes(0)


def test_bucket_for_takes_the_smallest_that_holds_the_batch():
    sizes = capture_sizes(20)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 20, 20]
    assert bucket_for(0, sizes) is None and bucket_for(21, sizes) is None


def test_eager_reasons():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kw = dict(enforce_eager=False, has_layer_kv_hook=False)
    assert "on cpu" in eager_reason(device=cpu, kernel_backend=Backend.AUTO, **kw)
    assert eager_reason(device=cuda, kernel_backend=Backend.AUTO, enforce_eager=True,
                        has_layer_kv_hook=False) == "enforce_eager is set"
    assert "prefill pod" in eager_reason(device=cuda, kernel_backend=Backend.AUTO,
                                         enforce_eager=False, has_layer_kv_hook=True)
    # The torch references read device values on the host: not capturable.
    assert "'torch' runs the torch references" in cuda_graph_unsupported_reason(cuda, "torch")
    # This suite interprets Triton (tests/conftest.py), which runs on the host.
    assert "TRITON_INTERPRET" in cuda_graph_unsupported_reason(cuda, Backend.TRITON)


def test_a_cpu_engine_captures_nothing(make_engine):
    assert make_engine().runner.graphs is None


def _greedy(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    return torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-5, rtol=0)


def _add(engines, requests, first_index):
    for engine in engines:
        for i, (n, max_tokens) in enumerate(requests, start=first_index):
            prompt = torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(i))
            engine.add_request(f"r{i}", prompt.tolist(),
                               SamplingParams(temperature=0, max_tokens=max_tokens,
                                              ignore_eos=True))


def _step_pair_to_the_end(make_engine, kernel_backend, first, later, join_step, exact):
    """Two engines step the same requests ((prompt length, max_tokens) each;
    `later` join at `join_step`); the second runs every pure-decode step
    through the padded bucket forward of buckets 1, 4 and 8. After every step
    the logits and every layer's whole cache are compared. Returns the
    pure-decode batch sizes seen and the padded runs per bucket."""
    kw = dict(kernel_backend=kernel_backend, num_blocks=96, max_num_seqs=8)
    eager, padded = make_engine(**kw), make_engine(**kw)
    runner = padded.runner
    runner.graphs = DecodeGraphs(runner.model, runner.inputs, runner.decode_graph_context,
                                 (1, 4, 8), capture=False)
    pair = (eager, padded)
    _add(pair, first, 0)
    step, decode_batches = 0, set()
    while eager.has_unfinished_requests():
        if step == join_step:
            _add(pair, later, len(first))
        plans = [e.scheduler.schedule() for e in pair]
        if all(s.num_new_tokens == 1 for s in plans[0].scheduled):
            decode_batches.add(len(plans[0].scheduled))
        results = [e.runner.execute(p.scheduled) for e, p in zip(pair, plans, strict=True)]
        assert _same(results[0].logits, results[1].logits, exact), f"step {step}"
        for a, b in zip(eager.kv_caches, padded.kv_caches, strict=True):
            assert _same(a, b, exact), f"cache differs after step {step}"
        tokens = _greedy(results[0].logits)
        for engine, plan, result in zip(pair, plans, results, strict=True):
            engine.scheduler.update_computed(plan)
            for request, token in zip(result.sampling_requests, tokens, strict=True):
                request.append_output_token(token)
                if request.num_output_tokens >= request.sampling_params.max_tokens:
                    engine._finish(request, type(request.status).FINISHED_LENGTH)
        step += 1
    assert not padded.has_unfinished_requests()
    return decode_batches, runner.graphs.num_runs


@pytest.mark.parametrize("kernel_backend", ["torch", "auto"])
def test_padded_decode_equals_the_unpadded_batch(make_engine, kernel_backend):
    """Buckets 1, 4 and 8 (1 is a bucket on every engine): batches of 2, 3 and
    5 are padded. Logits and every layer's whole cache stay bit-identical,
    with the torch reference and with the CPU attention path."""
    decode_batches, runs = _step_pair_to_the_end(
        make_engine, kernel_backend, first=[(23, 9), (40, 3), (7, 14)],
        later=[(16, 6), (31, 11), (5, 4)], join_step=4, exact=True)
    assert {2, 3, 5} <= decode_batches, decode_batches
    assert runs[1] > 0 and runs[4] > 0 and runs[8] > 0, runs


def test_padded_decode_with_triton_kernels(make_engine):
    """The same through the (interpreted) Triton kernels, shorter. The padded
    forward reads the full-width block table, whose split plan differs from
    the eager step's narrow one, so the two agree to rounding; a padding row
    that wrote a real slot or leaked into a real row would be far outside it."""
    decode_batches, runs = _step_pair_to_the_end(
        make_engine, "triton", first=[(9, 3), (17, 2), (5, 4)], later=[], join_step=-1,
        exact=False)
    assert {3, 2, 1} <= decode_batches and runs[4] > 0, (decode_batches, runs)

"""`LLMEngine` at tensor_parallel_size > 1 (real worker processes, gloo on
CPU, step descriptions over Unix sockets) against tensor_parallel_size 1 on
the same checkpoint: greedy tokens equal, with synchronous and async
scheduling, with several requests in flight (chunked prefills beside
decodes). The `base` model at TP=2 with 128-token blocks and prompts across
them; the `tiny` model at TP=4 (its 2 KV heads each on two ranks)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.make_model import ensure_model
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread_per_rank():
    """N ranks share this machine's cores: one torch thread each (workers
    take rank 0's count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1100, (n,), generator=g).tolist() for n in lengths]


def _generate(prompts: list[list[int]], **config) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(dtype="float32", **config))
    try:
        results = engine.generate(prompts, GREEDY)
    finally:
        engine.close()
    return [list(r.token_ids) for r in results], engine


def _no_worker_left(engine: LLMEngine) -> None:
    import os

    for pid in engine.tp.pids:
        with pytest.raises(ChildProcessError):  # reaped: not our child any more
            os.waitpid(pid, os.WNOHANG)


BASE = dict(block_size=128, num_blocks=16, max_num_batched_tokens=128, max_num_seqs=4)
# 300 and 140 tokens cross 128-token blocks; the 128-token budget chunks them
# beside the decodes of the short ones.
BASE_PROMPTS = _prompts([20, 300, 140, 7], seed=5)


@pytest.fixture(scope="module")
def base_tp1() -> list[list[int]]:
    tokens, _ = _generate(BASE_PROMPTS, model_dir=str(ensure_model("base")), **BASE)
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_base_at_tp2_equals_tp1(base_tp1, async_scheduling):
    tokens, engine = _generate(BASE_PROMPTS, model_dir=str(ensure_model("base")),
                               tensor_parallel_size=2, async_scheduling=async_scheduling, **BASE)
    assert tokens == base_tp1
    _no_worker_left(engine)


TINY = dict(block_size=16, num_blocks=40, max_num_batched_tokens=48, max_num_seqs=4)
TINY_PROMPTS = _prompts([5, 90, 33, 12, 61], seed=6)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tiny_at_tp4_equals_tp1(tiny_model_dir, async_scheduling):
    """Five prompts, four sequence slots and 40 blocks: admissions wait for
    finishes, chunks of 48 tokens mix with decodes."""
    expected, _ = _generate(TINY_PROMPTS, model_dir=str(tiny_model_dir), **TINY)
    tokens, engine = _generate(TINY_PROMPTS, model_dir=str(tiny_model_dir),
                               tensor_parallel_size=4, async_scheduling=async_scheduling, **TINY)
    assert tokens == expected
    assert len(engine.tp.pids) == 3
    _no_worker_left(engine)


@pytest.mark.parametrize(("fields", "message"), [
    ({"tensor_parallel_size": 0}, r"tensor_parallel_size must be an integer in \[1, 64\], got 0"),
    ({"tensor_parallel_size": 65}, r"in \[1, 64\], got 65"),
    ({"tensor_parallel_size": 2.0}, r"in \[1, 64\], got 2.0"),
    ({"tp_timeout_s": 0}, r"tp_timeout_s must be in \(0, 3600\] seconds, got 0"),
    ({"tp_timeout_s": 7200}, r"tp_timeout_s must be in \(0, 3600\]"),
])
def test_config_refuses_what_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_dir="m", **fields)
    assert EngineConfig(model_dir="m").tensor_parallel_size == 1

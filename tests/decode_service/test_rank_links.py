"""Rank 0's `DecodeRanks` over a real worker rank (an `LLMEngine` at TP=2 on
the tiny model, gloo, the worker running decode_service.rank_kv by name):
SETUP -> READY with the worker's own receiver and heads; EXPECT of a request
the worker cannot expect -> FAILED; a transfer past its deadline -> FAILED
with the receiver's reason; FORGET -> FORGOTTEN (and a late reply after it
is ignored); the pod failing (rank 1 killed) fails every pending future at
once. The landing path (LANDED) is in tests/integration/test_tp_decode_ranks.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from decode_service.injector import TransferFailed
from decode_service.rank_kv import RANK_SERVICE
from decode_service.rank_links import DecodeRanks
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kv_transfer.base import KVLayout, RankTarget
from kv_transfer.config import ReceiverConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def one_thread_per_rank():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def pod(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), dtype="float32",
                                    num_blocks=32, block_size=16, tensor_parallel_size=2,
                                    tp_timeout_s=30.0, rank_service=RANK_SERVICE))
    ranks = DecodeRanks(engine.tp, RankTarget(("127.0.0.1:1",), 0, 1))
    targets = ranks.start("tcp", [ReceiverConfig(capacity_bytes=1 << 22, secret=b"s" * 32,
                                                 generation=7)], timeout_s=30)
    yield engine, ranks, targets
    engine.close()


def _layout(tokens: int = 20) -> KVLayout:
    return KVLayout(2, tokens, 2, 16, "float32")  # the whole model's: each rank takes its heads


def test_ready_expect_failed_forget(pod):
    engine, ranks, targets = pod
    assert [(t.head_start, t.head_end) for t in targets] == [(0, 1), (1, 2)]
    assert targets[1].endpoints[0].startswith("127.0.0.1:")
    assert ranks.head_range(1) == (1, 2)
    slots = torch.arange(20, dtype=torch.int64)

    async def run() -> None:
        # a deadline already past: the worker's receiver refuses to expect it
        refused = ranks.expect("r-past", _layout(), time.time() - 1, 5.0, slots)
        for future in (refused.expecting, refused.landed):
            with pytest.raises(TransferFailed, match="decode rank 1 could not expect"):
                await asyncio.wait_for(future, 10)
        await ranks.forget("r-past", 10)  # FORGOTTEN even for what it never held
        # nothing arrives before the deadline: the receiver's sweeper fails it
        late = ranks.expect("r-late", _layout(), time.time() + 0.5, 5.0, slots)
        await asyncio.wait_for(late.expecting, 10)
        with pytest.raises(TransferFailed, match="deadline"):
            await asyncio.wait_for(late.landed, 10)
        await ranks.forget("r-late", 10)
        # forgotten while waiting: the landing future is cancelled, FORGOTTEN comes
        pending = ranks.expect("r-forgot", _layout(), time.time() + 30, 5.0, slots)
        await asyncio.wait_for(pending.expecting, 10)
        await ranks.forget("r-forgot", 10)
        assert pending.landed.cancelled()

    asyncio.run(run())
    assert engine.tp.control_sent == (7,)  # SETUP, 3 EXPECT, 3 FORGET


def test_a_dead_rank_fails_every_pending_future(pod):
    engine, ranks, _ = pod
    slots = torch.arange(20, dtype=torch.int64)

    async def run() -> None:
        pending = ranks.expect("r", _layout(), time.time() + 60, 30.0, slots)
        await asyncio.wait_for(pending.expecting, 10)
        os.kill(engine.tp.pids[0], signal.SIGKILL)
        with pytest.raises(TransferFailed, match="tensor-parallel rank 1 .* exited"):
            await asyncio.wait_for(pending.landed, 10)
        await asyncio.wait_for(ranks.forget("r", 30), 5)  # nobody left to write: at once
        with pytest.raises(TransferFailed, match="rank 1"):
            ranks.expect("r2", _layout(), time.time() + 60, 30.0, slots)

    asyncio.run(run())

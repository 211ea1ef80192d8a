"""`KVImport`: one request's import from reserve to commit, or to free.

A real `EngineLoop` over the tiny model and a real `KVInjector` over its
cache; the receiver is a recording stand-in, and the layers are handed to
the injector the way the receiver's I/O threads do.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from decode_service.injector import KVInjector, TransferFailed
from decode_service.kv_import import ImportState, KVImport, RemoteKV
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.errors import CapacityError
from engine.llm_engine import LLMEngine
from engine.metrics import PodMetrics
from engine.request_stream import RequestAborted
from engine.sampling_params import SamplingParams
from kv_transfer.base import KVLayout, KVReceiver, ReceiverStats, TransferTarget
from kv_transfer.errors import BufferPoolExhausted
from pod.kv_shape import KVShape

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(3, 23))  # 20 tokens
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class _Receiver(KVReceiver):
    """Records the calls `KVImport` makes, in order, in a shared log."""

    def __init__(self, log: list[str], full: bool = False) -> None:
        self.log = log
        self.full = full

    def start(self) -> None: ...

    def close(self) -> None: ...

    @property
    def endpoints(self) -> tuple[str, ...]:
        return ("127.0.0.1:1",)

    def expect(self, request_id: str, layout: KVLayout, deadline: float,
               transfer_timeout_s: float | None = None) -> TransferTarget:
        self.log.append(f"receiver.expect {request_id} {layout.num_tokens}"
                        + (f" from {layout.token_offset}" if layout.token_offset else ""))
        if self.full:
            raise BufferPoolExhausted("landing pool has 0 of 64 bytes free")
        return TransferTarget(self.endpoints, b"t", "tcp", 1, deadline)

    def release(self, request_id: str) -> bool:
        self.log.append(f"receiver.release {request_id}")
        return True

    def cancel(self, request_id: str, reason: str) -> bool:
        self.log.append(f"receiver.cancel {request_id} {reason}")
        return True

    def stats(self) -> ReceiverStats:
        return ReceiverStats(0, 64, 0, 0, 0, {}, 0)


class _Injector(KVInjector):
    def __init__(self, log: list[str], *args) -> None:
        super().__init__(*args)
        self.log = log

    async def forget(self, request_id: str) -> None:
        await super().forget(request_id)
        self.log.append(f"injector.forget {request_id}")


class _Loop(EngineLoop):
    def __init__(self, log: list[str], *args) -> None:
        super().__init__(*args)
        self.log = log

    async def abort(self, request_id: str, reason: str) -> bool:
        found = await super().abort(request_id, reason)
        self.log.append(f"loop.abort {request_id} {reason} {found}")
        return found


def _run(tiny_model_dir, scenario, *, full=False, timeout_s=30.0, num_blocks=64):
    """Run `scenario(loop, remote, log)` on a fresh loop; returns its result."""

    async def main():
        log: list[str] = []
        metrics = PodMetrics.create("decode")
        engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir), dtype="float32",
                                        num_blocks=num_blocks, block_size=16))
        loop = _Loop(log, engine, metrics)
        injector = _Injector(log, loop.kv_caches(), metrics)
        _, _, _, heads, dim = loop.kv_caches()[0].shape
        shape = KVShape(len(loop.kv_caches()), heads, dim, "float32")
        remote = RemoteKV(_Receiver(log, full), injector, shape, timeout_s,
                          reservation_timeout_s=timeout_s)
        loop.start()
        try:
            return await asyncio.wait_for(scenario(loop, remote, log), 60)
        finally:
            loop.stop()
            injector.close()

    return asyncio.run(main())


def _send_all_layers(remote: RemoteKV, request_id: str, first_token_id: int) -> None:
    """What the receiver's I/O threads do once every layer landed and END came."""
    for layer in range(remote.kv_shape.num_layers):
        view = torch.randn(2, len(PROMPT), remote.kv_shape.num_kv_heads, remote.kv_shape.head_dim)
        remote.injector.on_layer_ready(request_id, layer, view)
    remote.injector.on_complete(request_id, first_token_id)


def test_reserve_open_wait_commit_then_tokens_stream(tiny_model_dir):
    async def scenario(loop, remote, log):
        kv = KVImport("r", loop, remote)
        reservation = await kv.reserve(PROMPT, PARAMS, [])
        target = kv.open()
        assert kv.state is ImportState.OPEN and kv.holds_resources
        _send_all_layers(remote, "r", 7)
        assert await kv.wait() == 7
        assert kv.state is ImportState.INJECTED
        stream = await kv.commit()
        assert kv.state is ImportState.COMMITTED and not kv.holds_resources
        tokens = [t async for output in stream for t in output.new_token_ids]
        await kv.free("client")  # after commit: nothing to give back
        return reservation, target, tokens, loop.stats

    reservation, target, tokens, stats = _run(tiny_model_dir, scenario)
    assert reservation.num_context_tokens == 20 and len(reservation.block_ids) == 2  # 20 + 4
    assert target.transport == "tcp" and target.ticket == b"t"
    assert len(tokens) == 3  # the first of max_tokens=4 came from the prefill pod
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_held_prefix_is_not_expected_and_few_new_tokens_run_locally(tiny_model_dir):
    async def scenario(loop, remote, log):
        first = KVImport("a", loop, remote)
        await first.reserve(PROMPT, PARAMS, [])
        first.open()
        _send_all_layers(remote, "a", 7)
        await first.wait()
        [_ async for _ in await first.commit()]  # done: blocks 0 (full) cached
        longer = PROMPT + [40, 41, 42]  # 23 tokens, 16 held, 7 new
        held = KVImport("b", loop, remote)
        reservation = await held.reserve(longer, PARAMS, [], local_prefill_below=7)
        held.open()
        assert held.held_bytes == remote.kv_shape.bytes_of(16)
        await held.free("client")
        local = KVImport("c", loop, remote)
        assert await local.reserve(longer, PARAMS, [], local_prefill_below=8) is None
        assert local.state is ImportState.LOCAL and not local.holds_resources
        outputs = [output async for output in local.stream]
        return reservation, outputs, log, loop.stats

    reservation, outputs, log, stats = _run(tiny_model_dir, scenario)
    assert (reservation.num_held_tokens, reservation.num_new_tokens) == (16, 7)
    assert "receiver.expect b 7 from 16" in log
    assert not any(line.startswith("receiver.expect c") for line in log)
    assert sum(len(o.new_token_ids) for o in outputs) == 4  # all of max_tokens, here
    assert outputs[0].num_cached_tokens == 16
    assert stats.num_free_blocks == stats.num_total_blocks


def test_the_injector_thread_commits_without_the_event_loop(tiny_model_dir):
    async def scenario(loop, remote, log):
        kv = KVImport("r", loop, remote)
        await kv.reserve(PROMPT, PARAMS, [])
        kv.open()
        _send_all_layers(remote, "r", 7)
        # This event loop is blocked from here on: R must still join the batch
        # (the engine loop thread commits it and steps it to its end).
        deadline = time.monotonic() + 20
        while loop.stats.num_free_blocks != loop.stats.num_total_blocks:
            assert time.monotonic() < deadline, "R was not committed while the event loop slept"
            time.sleep(0.01)
        assert kv.state is ImportState.OPEN  # the event loop has not looked yet
        assert await kv.wait() == 7
        stream = await kv.commit()
        tokens = [t async for output in stream for t in output.new_token_ids]
        return tokens, log

    tokens, log = _run(tiny_model_dir, scenario)
    assert len(tokens) == 3
    assert "injector.forget r" not in log  # the injector let go of R by itself
    assert log[-1] == "receiver.release r"


def test_a_commit_the_engine_refuses_fails_the_commit_and_free_still_frees(tiny_model_dir):
    async def scenario(loop, remote, log):
        kv = KVImport("r", loop, remote)
        await kv.reserve(PROMPT, PARAMS, [])
        kv.open()
        _send_all_layers(remote, "r", 10**6)  # outside the vocabulary
        await kv.wait()
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await kv.commit()
        await kv.free("transfer")
        await loop.call(lambda engine: None)
        return loop.stats

    stats = _run(tiny_model_dir, scenario)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_failed_transfer_is_freed_in_the_safe_order(tiny_model_dir):
    async def scenario(loop, remote, log):
        kv = KVImport("r", loop, remote)
        await kv.reserve(PROMPT, PARAMS, [])
        kv.open()
        remote.injector.on_failed("r", "checksum: layer 0")
        with pytest.raises(TransferFailed) as err:
            await kv.wait()
        assert kv.state is ImportState.OPEN
        await kv.free("transfer")
        await kv.free("transfer")  # a second free is a no-op
        await loop.call(lambda engine: None)  # stats published after the abort
        return err.value.reason, kv.state, loop.stats

    log: list[str] = []
    reason, state, stats = _run(tiny_model_dir, lambda *a: _with_log(scenario, log, *a))
    assert reason == "checksum: layer 0" and state is ImportState.FREED
    assert log == [
        "receiver.expect r 20",
        "receiver.cancel r decode request ended before commit (transfer)",
        "injector.forget r",
        "receiver.release r",
        "loop.abort r transfer True",
    ]
    assert stats.num_free_blocks == stats.num_total_blocks


async def _with_log(scenario, out: list[str], loop, remote, log):
    """Run `scenario` and copy the shared call log into `out` (also on failure)."""
    try:
        return await scenario(loop, remote, log)
    finally:
        out.extend(log)


def test_abort_fails_the_wait_unless_the_kv_is_already_in(tiny_model_dir):
    async def scenario(loop, remote, log):
        waiting = KVImport("a", loop, remote)
        await waiting.reserve(PROMPT, PARAMS, [])
        waiting.open()
        waiting.abort("aborted by caller")
        with pytest.raises(RequestAborted) as err:
            await waiting.wait()
        await waiting.free("abort_rpc")

        ready = KVImport("b", loop, remote)
        await ready.reserve(PROMPT, PARAMS, [])
        ready.open()
        _send_all_layers(remote, "b", 5)
        await remote.injector.forget("sync")  # a barrier: b's future is resolved
        await asyncio.sleep(0)
        ready.abort("too late")  # its KV is in: commit goes on
        first = await ready.wait()
        await ready.free("client")
        return err.value.reason, first

    assert _run(tiny_model_dir, scenario) == ("aborted by caller", 5)


def test_no_kv_by_the_deadline_fails_the_wait(tiny_model_dir):
    async def scenario(loop, remote, log):
        kv = KVImport("r", loop, remote)
        await kv.reserve(PROMPT, PARAMS, [])
        kv.open()
        with pytest.raises(TransferFailed) as err:
            await kv.wait()
        await kv.free("transfer")
        return err.value.reason

    reason = _run(tiny_model_dir, scenario, timeout_s=0.1)
    assert reason == "deadline: no KV within the 0.1s reservation timeout"


def test_a_full_landing_pool_leaves_the_blocks_to_free(tiny_model_dir):
    async def scenario(loop, remote, log):
        kv = KVImport("r", loop, remote)
        await kv.reserve(PROMPT, PARAMS, [])
        with pytest.raises(BufferPoolExhausted):
            kv.open()
        assert kv.state is ImportState.RESERVED and kv.holds_resources
        await kv.free("client")
        await loop.call(lambda engine: None)
        return loop.stats

    log: list[str] = []
    stats = _run(tiny_model_dir, lambda *a: _with_log(scenario, log, *a), full=True)
    assert log[-1] == "loop.abort r client True"
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_refused_reserve_holds_nothing_and_frees_nothing(tiny_model_dir):
    async def scenario(loop, remote, log):
        first = KVImport("r", loop, remote)
        await first.reserve(PROMPT, PARAMS, [])  # 2 of the 4 blocks
        first.open()
        duplicate = KVImport("r", loop, remote)
        with pytest.raises(ValueError, match="request_id 'r' is already in use on this pod"):
            await duplicate.reserve(PROMPT, PARAMS, [])
        too_big = KVImport("big", loop, remote)
        with pytest.raises(CapacityError, match="request needs 3 KV blocks, 2 are free"):
            await too_big.reserve(list(range(3, 43)), PARAMS, [])
        for kv in (duplicate, too_big):
            assert kv.state is ImportState.RESERVING and not kv.holds_resources
            await kv.free("client")  # must not touch the other request named "r"
        with pytest.raises(RuntimeError, match="wait\\(\\) in import state reserving"):
            await duplicate.wait()
        calls = list(log)
        await first.free("client")
        return calls, first.state

    assert _run(tiny_model_dir, scenario, num_blocks=4) == (
        ["receiver.expect r 20"], ImportState.FREED)

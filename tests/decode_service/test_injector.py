"""`KVInjector`: layers written into reserved slots, in order, off the caller's thread.

The listener hooks are called here from the test thread, the way the
receiver's I/O threads call them; the cache is a real paged layout.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from decode_service.injector import KVInjector, TransferFailed
from decode_service.split_head import SplitHead
from decode_service.transfer_eta import TransferETA
from engine.layer_gate import LayerGate
from engine.metrics import PodMetrics

pytestmark = pytest.mark.timeout(60)

NUM_LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 4, 16, 2, 64


def _caches() -> list[torch.Tensor]:
    return [torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM) for _ in range(NUM_LAYERS)]


def _slots(blocks: list[int], num_tokens: int) -> torch.Tensor:
    return torch.tensor([blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(num_tokens)],
                        dtype=torch.int64)


def test_layers_land_in_the_reserved_slots_and_the_future_gets_the_first_token():
    caches = _caches()
    metrics = PodMetrics.create("decode")
    injector = KVInjector(caches, metrics)

    async def scenario():
        slots = _slots([3, 1], 20)  # 20 tokens over blocks 3 then 1
        ready = injector.expect("r", slots, NUM_LAYERS, num_bytes=1234)
        sent = [torch.randn(2, 20, HEADS, DIM) for _ in range(NUM_LAYERS)]
        for layer, kv in enumerate(sent):
            injector.on_layer_ready("r", layer, kv)
        injector.on_complete("r", 42)
        assert await asyncio.wait_for(ready, 10) == 42
        await injector.forget("r")
        return sent

    sent = asyncio.run(scenario())
    injector.close()
    for layer, kv in enumerate(sent):
        flat = caches[layer].view(2, BLOCKS * BLOCK, HEADS, DIM)
        assert torch.equal(flat[:, 48:64], kv[:, :16])  # block 3 holds tokens 0..15
        assert torch.equal(flat[:, 16:20], kv[:, 16:])  # block 1 holds tokens 16..19
        assert flat[:, :16].abs().sum() == 0 and flat[:, 20:48].abs().sum() == 0
    assert metrics.kv_transfer_bytes._value.get() == 1234


@pytest.mark.parametrize(("events", "reason"), [
    ([("failed", "deadline: deadline 1.000 passed")], "deadline: deadline 1.000 passed"),
    ([("layer", 0), ("complete", 7)], "injection: END after 1 of 2 layers"),
    ([("layer", 1)], "injection: layer 1 arrived, expected layer 0"),
])
def test_failures_reject_the_future_with_the_reason(events, reason):
    caches = _caches()
    injector = KVInjector(caches, PodMetrics.create("decode"))

    async def scenario():
        ready = injector.expect("r", _slots([0], 5), NUM_LAYERS, num_bytes=1)
        for kind, arg in events:
            if kind == "layer":
                injector.on_layer_ready("r", arg, torch.ones(2, 5, HEADS, DIM))
            elif kind == "complete":
                injector.on_complete("r", arg)
            else:
                injector.on_failed("r", arg)
        with pytest.raises(TransferFailed) as err:
            await asyncio.wait_for(ready, 10)
        await injector.forget("r")
        return err.value

    err = asyncio.run(scenario())
    injector.close()
    assert err.reason == reason


def test_nothing_is_written_after_forget():
    caches = _caches()
    injector = KVInjector(caches, PodMetrics.create("decode"))

    async def scenario():
        injector.expect("r", _slots([2], 5), NUM_LAYERS, num_bytes=1)
        await injector.forget("r")
        injector.on_layer_ready("r", 0, torch.ones(2, 5, HEADS, DIM))  # a late layer
        await injector.forget("sync")  # a barrier: the late layer has been handled

    asyncio.run(scenario())
    injector.close()
    assert all(cache.abs().sum() == 0 for cache in caches)


def test_duplicate_expect_is_refused():
    injector = KVInjector(_caches(), PodMetrics.create("decode"))

    async def scenario():
        injector.expect("r", _slots([0], 5), NUM_LAYERS, num_bytes=1)
        with pytest.raises(ValueError, match="request 'r' is already waiting for KV"):
            injector.expect("r", _slots([1], 5), NUM_LAYERS, num_bytes=1)

    asyncio.run(scenario())
    injector.close()


def test_restart_reinjects_from_layer_0_over_the_same_slots():
    caches = _caches()
    injector = KVInjector(caches, PodMetrics.create("decode"))

    async def scenario():
        slots = _slots([2], 10)
        ready = injector.expect("r", slots, NUM_LAYERS, num_bytes=10)
        old = torch.full((2, 10, HEADS, DIM), 7.0)
        injector.on_layer_ready("r", 0, old)
        # the receiver calls on_restart from an I/O thread and waits for it
        await asyncio.to_thread(injector.on_restart, "r", "sender_lost: connection_lost")
        sent = [torch.randn(2, 10, HEADS, DIM) for _ in range(NUM_LAYERS)]
        for layer, kv in enumerate(sent):
            injector.on_layer_ready("r", layer, kv)
        injector.on_complete("r", 5)
        assert await asyncio.wait_for(ready, 10) == 5
        await injector.forget("r")
        return sent

    sent = asyncio.run(scenario())
    injector.close()
    for layer, kv in enumerate(sent):
        flat = caches[layer].view(2, BLOCKS * BLOCK, HEADS, DIM)
        assert torch.equal(flat[:, 32:42], kv)  # the old attempt's 7.0 is overwritten


def test_restart_after_all_layers_then_end_counts_only_the_new_attempt():
    injector = KVInjector(_caches(), PodMetrics.create("decode"))

    async def scenario():
        ready = injector.expect("r", _slots([0], 4), NUM_LAYERS, num_bytes=4)
        for layer in range(NUM_LAYERS):
            injector.on_layer_ready("r", layer, torch.ones(2, 4, HEADS, DIM))
        await asyncio.to_thread(injector.on_restart, "r", "sender_lost: aborted: x")
        injector.on_layer_ready("r", 0, torch.ones(2, 4, HEADS, DIM))
        injector.on_complete("r", 9)  # END after 1 of 2 layers of the new attempt
        with pytest.raises(TransferFailed, match="END after 1 of 2 layers"):
            await asyncio.wait_for(ready, 10)
        await injector.forget("r")

    asyncio.run(scenario())
    injector.close()


def test_on_ready_runs_on_the_injector_thread_before_the_future_and_r_is_let_go():
    import threading

    injector = KVInjector(_caches(), PodMetrics.create("decode"))
    calls: list[tuple[int, str, bool]] = []

    async def scenario():
        ready = None

        def on_ready(token: int) -> None:
            calls.append((token, threading.current_thread().name, ready.done()))

        ready = injector.expect("r", _slots([0], 5), NUM_LAYERS, num_bytes=1, on_ready=on_ready)
        for layer in range(NUM_LAYERS):
            injector.on_layer_ready("r", layer, torch.ones(2, 5, HEADS, DIM))
        injector.on_complete("r", 9)
        assert await asyncio.wait_for(ready, 10) == 9
        # R left the table at READY: it can be expected again without a forget
        injector.expect("r", _slots([1], 5), NUM_LAYERS, num_bytes=1)
        await injector.forget("r")

        def refuse(token: int) -> None:
            raise RuntimeError("engine loop is stopped")

        failing = injector.expect("s", _slots([2], 5), NUM_LAYERS, num_bytes=1, on_ready=refuse)
        for layer in range(NUM_LAYERS):
            injector.on_layer_ready("s", layer, torch.ones(2, 5, HEADS, DIM))
        injector.on_complete("s", 3)
        with pytest.raises(TransferFailed) as err:
            await asyncio.wait_for(failing, 10)
        await injector.forget("s")
        return err.value.reason

    reason = asyncio.run(scenario())
    injector.close()
    assert calls == [(9, "kv-injector", False)]
    assert reason == "injection: engine loop is stopped"


def test_the_injector_tells_the_eta_each_layer_and_end_with_the_times_it_read():
    """The injector feeds its `TransferETA`: the ETA extrapolates the layers'
    cadence and learns END's lag (decode_service/transfer_eta.py)."""
    # the injector thread reads the clock once per layer and once per END, in queue order
    ticks = iter([10.0, 10.1, 10.2, 10.3, 10.32,  # r: four layers 0.1 s apart, END 0.02 s after
                  20.0, 20.1,  # s: two layers 0.1 s apart
                  20.2, 20.22])  # t: two layers 0.02 s apart
    layers = 4
    caches = [torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM) for _ in range(layers)]
    eta = TransferETA()
    injector = KVInjector(caches, PodMetrics.create("decode"), clock=lambda: next(ticks), eta=eta)
    kv = torch.ones(2, 5, HEADS, DIM)

    async def layers_in(request_id: str, *numbers: int) -> None:
        for layer in numbers:
            injector.on_layer_ready(request_id, layer, kv)
        await injector.forget("barrier")  # items run in order: those layers are in

    async def scenario():
        r = injector.expect("r", _slots([0], 5), layers, num_bytes=1)
        assert eta.next_ready() is None
        await layers_in("r", 0)
        assert eta.next_ready() is None  # one layer: no cadence yet
        await layers_in("r", 1)
        # two layers to go plus END's lag, one cadence until a request taught otherwise
        assert eta.next_ready() == ("r", pytest.approx(10.1 + 0.1 * (2 + 1.0)))
        await layers_in("r", 2, 3)
        assert eta.next_ready() == ("r", pytest.approx(10.3 + 0.1 * 1.0))
        injector.on_complete("r", 7)
        assert await asyncio.wait_for(r, 10) == 7
        assert eta.next_ready() is None

        # END came 0.2 cadences after r's last layer: the lag moves 1.0 -> 0.84
        injector.expect("s", _slots([1], 5), layers, num_bytes=1)
        await layers_in("s", 0, 1)
        assert eta.next_ready() == ("s", pytest.approx(20.1 + 0.1 * (2 + 0.84)))
        t = injector.expect("t", _slots([2], 5), layers, num_bytes=1)
        await layers_in("t", 0, 1)
        # t started later but runs faster: it is expected first
        assert eta.next_ready() == ("t", pytest.approx(20.22 + 0.02 * (2 + 0.84)))
        injector.on_failed("t", "sender_lost: connection_lost")
        with pytest.raises(TransferFailed):
            await asyncio.wait_for(t, 10)
        assert eta.next_ready()[0] == "s"  # a failed transfer is not waited for
        await asyncio.to_thread(injector.on_restart, "s", "sender_lost: connection_lost")
        assert eta.next_ready() is None  # its layers come again from 0
        await injector.forget("s")
        await injector.forget("t")

    asyncio.run(scenario())
    injector.close()


def test_a_split_head_marks_its_gate_per_layer_and_starts_the_tail_after_layer_0():
    """The split prefill's head (engine.layer_gate): each layer is in the
    cache before its mark, the tail starts once, after layer 0, and END
    settles R as usual (the prefill pod's token is the future's)."""
    caches = _caches()
    injector = KVInjector(caches, PodMetrics.create("decode"))
    gate = LayerGate(NUM_LAYERS)
    seen: list[tuple[str, int]] = []

    async def scenario():
        slots = _slots([1], 12)
        sent = [torch.randn(2, 12, HEADS, DIM) for _ in range(NUM_LAYERS)]

        def started() -> None:
            flat = caches[0].view(2, BLOCKS * BLOCK, HEADS, DIM)
            assert torch.equal(flat[:, 16:28], sent[0])  # layer 0 is in already
            seen.append(("tail", gate._layers_in))

        ready = injector.expect("r", slots, NUM_LAYERS, num_bytes=1,
                                split=SplitHead(gate, started))
        for layer, kv in enumerate(sent):
            injector.on_layer_ready("r", layer, kv)
        injector.on_complete("r", 9)
        assert await asyncio.wait_for(ready, 10) == 9

    asyncio.run(scenario())
    injector.close()
    assert seen == [("tail", 1)]
    assert gate.complete and not gate.failed


@pytest.mark.parametrize("how", ["failed", "restart", "forget"])
def test_a_split_head_that_cannot_finish_opens_its_gate(how):
    """Whatever stops the head (a failed transfer, a sender restart: the tail
    may have read the layers it would overwrite, a forget before R
    settled), the gate fails, so the engine's forward never waits for
    layers that will not come."""
    injector = KVInjector(_caches(), PodMetrics.create("decode"))
    gate = LayerGate(NUM_LAYERS)

    async def scenario():
        ready = injector.expect("r", _slots([0], 8), NUM_LAYERS, num_bytes=1,
                                split=SplitHead(gate, lambda: None))
        injector.on_layer_ready("r", 0, torch.randn(2, 8, HEADS, DIM))
        if how == "failed":
            injector.on_failed("r", "sender_aborted: prefill pod stopped")
        elif how == "restart":
            await asyncio.to_thread(injector.on_restart, "r", "sender_lost: connection_lost")
        else:
            await injector.forget("r")
            return
        with pytest.raises(TransferFailed):
            await asyncio.wait_for(ready, 10)

    asyncio.run(scenario())
    injector.close()
    assert gate.failed and not gate.wait(1)

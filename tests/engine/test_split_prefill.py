"""The engine side of a split prefill (engine.layer_gate, `LLMEngine.start_tail`):
a reservation whose head [0, s) arrives layer by layer while the engine
computes the tail [s, n) continues exactly like the colocated engine, each
layer of the tail waits for that layer of the head, and a head that never
arrives whole ends the request aborted, its blocks free and out of the
prefix cache."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kernels
from engine.layer_gate import LayerGate
from engine.sampling_params import SamplingParams
from tests.engine.test_remote import CaptureHook, _finish

pytestmark = pytest.mark.timeout(120)

PROMPT_LEN, HEAD = 75, 40


def _prompt(seed: int) -> list[int]:
    return torch.randint(10, 1100, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


def _head_kv(make_engine, prompt: list[int]) -> CaptureHook:
    """The prefill pod's side: the head alone, each layer's KV captured."""
    hook = CaptureHook()
    prefill = make_engine(block_size=16, max_num_batched_tokens=32, layer_kv_hook=hook)
    prefill.add_request("q", prompt[:HEAD], SamplingParams(temperature=0, max_tokens=1),
                        prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    return hook


class Injector(threading.Thread):
    """Writes the head's layers into the reservation's slots, each one only
    once the forward waits for it (so every layer after the first is
    provably gated), then marks it in; `fail_after` layers, it fails."""

    def __init__(self, engine, hook: CaptureHook, slots: torch.Tensor, gate: LayerGate,
                 fail_after: int | None = None) -> None:
        super().__init__(daemon=True)
        self.engine, self.hook, self.slots, self.gate = engine, hook, slots, gate
        self.fail_after = fail_after
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for layer, cache in enumerate(self.engine.kv_caches):
                if layer == self.fail_after:
                    self.gate.fail()
                    return
                deadline = time.monotonic() + 30
                while layer and self.gate.waits < layer:  # the forward is at this layer
                    assert time.monotonic() < deadline, f"the forward never waited for {layer}"
                    time.sleep(0.002)
                kv = self.hook.layer("q", layer)
                assert kv.shape[1] == HEAD
                kernels.inject_kv(cache, kv, self.slots[:HEAD])
                self.gate.mark(layer + 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            self.gate.fail()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=10),
    SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=10, ignore_eos=True),
], ids=["greedy", "seeded"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_tail_over_a_head_arriving_layer_by_layer_continues_like_colocated(
        make_engine, params, async_scheduling):
    prompt = _prompt(41)
    colocated = make_engine()
    colocated.add_request("q", prompt, params)
    expected = _finish(colocated, "q")

    hook = _head_kv(make_engine, prompt)
    decode = make_engine(block_size=16, num_blocks=16, enable_prefix_caching=False,
                         async_scheduling=async_scheduling)
    reservation = decode.reserve_remote("q", prompt, params)
    gate = LayerGate(len(decode.kv_caches))
    injector = Injector(decode, hook, reservation.slot_mapping, gate)
    decode.start_tail("q", HEAD, gate)
    injector.start()
    got = _finish(decode, "q")
    injector.join(30)
    assert injector.error is None, injector.error
    assert got == expected
    # the forward reached every layer after the first before its head was in
    assert gate.waits == len(decode.kv_caches) - 1
    assert decode.stats().num_free_blocks == 16


def test_a_head_that_never_arrives_whole_aborts_the_request(make_engine):
    prompt = _prompt(42)
    params = SamplingParams(temperature=0, max_tokens=6)
    hook = _head_kv(make_engine, prompt)
    decode = make_engine(block_size=16, num_blocks=16, enable_prefix_caching=True)
    reservation = decode.reserve_remote("q", prompt, params)
    gate = LayerGate(len(decode.kv_caches))
    injector = Injector(decode, hook, reservation.slot_mapping, gate, fail_after=1)
    decode.start_tail("q", HEAD, gate)
    injector.start()
    tokens, reason = _finish(decode, "q")
    injector.join(30)
    assert injector.error is None, injector.error
    assert (tokens, reason) == ([], "abort")
    assert decode.stats().num_free_blocks == 16
    # nothing it computed over the missing layers entered the prefix cache
    hits = decode.stats().prefix_cache_hits
    decode.add_request("again", prompt, params)
    _finish(decode, "again")
    assert decode.stats().prefix_cache_hits == hits


def test_start_tail_refuses_what_it_cannot_do(make_engine):
    decode = make_engine(block_size=16, num_blocks=16, enable_prefix_caching=False)
    layers = len(decode.kv_caches)
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="not awaiting remote KV"):
        decode.start_tail("nobody", 8, LayerGate(layers))
    decode.reserve_remote("q", _prompt(43), params)
    with pytest.raises(ValueError, match=r"num_head_tokens 75 must be in \[0, 75\)"):
        decode.start_tail("q", PROMPT_LEN, LayerGate(layers))
    with pytest.raises(ValueError, match=f"the gate counts {layers + 1} layers"):
        decode.start_tail("q", HEAD, LayerGate(layers + 1))


def test_the_gate_opens_layer_by_layer_and_on_failure():
    gate = LayerGate(3)
    assert gate.wait(-1) and not gate.complete
    opened: list[int] = []

    def waiter(layer: int) -> None:
        if gate.wait(layer):
            opened.append(layer)

    threads = [threading.Thread(target=waiter, args=(layer,)) for layer in (0, 1, 2)]
    for thread in threads:
        thread.start()
    gate.mark(2)
    for thread in threads[:2]:
        thread.join(10)
    assert sorted(opened) == [0, 1] and threads[2].is_alive()
    gate.fail()
    threads[2].join(10)
    assert not threads[2].is_alive()
    assert sorted(opened) == [0, 1] and gate.complete and gate.failed
    assert not gate.wait(2)
    with pytest.raises(ValueError, match=r"layers_in must be in \[0, 3\]"):
        gate.mark(4)
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        LayerGate(0)

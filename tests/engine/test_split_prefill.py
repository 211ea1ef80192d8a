"""The engine side of a split prefill (engine.layer_gate, engine.tail_worker,
`LLMEngine.start_tail`): a reservation whose head [0, s) arrives layer by
layer while the engine computes the tail [s, n) continues exactly like the
colocated engine, each layer of the tail waits for that layer of the head,
a running batch keeps decoding while the tail waits, and a head that never
arrives whole (or an abort while the tail computes) ends the request
aborted, its blocks free once nothing writes them and out of the prefix
cache."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kernels
from engine.layer_gate import LayerGate
from engine.sampling_params import SamplingParams
from tests.engine.test_remote import CaptureHook

pytestmark = pytest.mark.timeout(120)

PROMPT_LEN, HEAD = 75, 40


def _finish(engine, request_id: str, others: dict[str, list[int]] | None = None
            ) -> tuple[list[int], str | None]:
    """Step until nothing is left, a tail on its own thread included: the
    request's tokens and finish reason; `others` collects the rest's tokens."""
    tokens, reason = [], None
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() or engine.tails.num_running:
        assert time.monotonic() < deadline, "the engine never finished"
        if not engine.has_unfinished_requests():
            time.sleep(0.001)  # only a tail computes
            continue
        for out in engine.step():
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
                reason = out.finish_reason or reason
            elif others is not None:
                others.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, reason


def _prompt(seed: int) -> list[int]:
    return torch.randint(10, 1100, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


def _head_kv(make_engine, prompt: list[int], head: int = HEAD) -> CaptureHook:
    """The prefill pod's side: the head alone, each layer's KV captured."""
    hook = CaptureHook()
    prefill = make_engine(block_size=16, max_num_batched_tokens=32, layer_kv_hook=hook)
    prefill.add_request("q", prompt[:head], SamplingParams(temperature=0, max_tokens=1),
                        prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    return hook


class Injector(threading.Thread):
    """Writes the head's layers into the reservation's slots, each one only
    once the forward waits for it (so every layer after the first is
    provably gated), then marks it in; `fail_after` layers, it fails."""

    def __init__(self, engine, hook: CaptureHook, slots: torch.Tensor, gate: LayerGate,
                 fail_after: int | None = None, head: int = HEAD) -> None:
        super().__init__(daemon=True)
        self.engine, self.hook, self.slots, self.gate = engine, hook, slots, gate
        self.fail_after, self.head = fail_after, head
        self.error: BaseException | None = None
        self.hold = threading.Event()  # set: the next layer waits until cleared

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
                while self.hold.is_set():
                    assert time.monotonic() < deadline, "held too long"
                    time.sleep(0.002)
                if self.gate.failed:  # the request was aborted: its slots are not ours
                    return
                kv = self.hook.layer("q", layer)
                assert kv.shape[1] == self.head
                kernels.inject_kv(cache, kv, self.slots[:self.head])
                self.gate.mark(layer + 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            self.gate.fail()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=10),
    SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=10, ignore_eos=True),
], ids=["greedy", "seeded"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("head", [HEAD, PROMPT_LEN - 1], ids=["tail-worker", "tail-of-one"])
def test_a_tail_over_a_head_arriving_layer_by_layer_continues_like_colocated(
        make_engine, params, async_scheduling, head):
    """A tail of several tokens computes on the tail worker; a tail of one
    token (the prompt's last) waits there for the whole head, then runs in
    the next step."""
    prompt = _prompt(41)
    colocated = make_engine()
    colocated.add_request("q", prompt, params)
    expected = _finish(colocated, "q")

    hook = _head_kv(make_engine, prompt, head)
    decode = make_engine(block_size=16, num_blocks=16, enable_prefix_caching=False,
                         async_scheduling=async_scheduling)
    reservation = decode.reserve_remote("q", prompt, params)
    gate = LayerGate(len(decode.kv_caches))
    injector = Injector(decode, hook, reservation.slot_mapping, gate, head=head)
    decode.start_tail("q", head, gate)
    assert decode.tails.num_running == 1
    injector.start()
    got = _finish(decode, "q")
    injector.join(30)
    assert injector.error is None, injector.error
    assert got == expected
    # the forward reached every layer after the first before its head was in
    # (the first too, where it got there before the injector)
    assert gate.waits >= len(decode.kv_caches) - 1
    assert decode.stats().num_free_blocks == 16


def test_a_running_batch_decodes_on_while_a_tail_waits_for_its_head(make_engine):
    """The tail's forward waits for the head on the tail worker, not in a
    step: a request already decoding gets a token every step meanwhile, and
    both end as each would alone."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt, other = _prompt(44), _prompt(45)[:20]
    colocated = make_engine()
    colocated.add_request("q", prompt, params)
    expected = _finish(colocated, "q")
    colocated.add_request("other", other, params)
    expected_other = _finish(colocated, "other")

    hook = _head_kv(make_engine, prompt)
    decode = make_engine(block_size=16, num_blocks=16, enable_prefix_caching=False)
    decode.add_request("other", other, params)
    tokens: dict[str, list[int]] = {}
    for out in decode.step():  # its prompt, and its first token
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    reservation = decode.reserve_remote("q", prompt, params)
    gate = LayerGate(len(decode.kv_caches))
    injector = Injector(decode, hook, reservation.slot_mapping, gate)
    injector.hold.set()  # no layer of the head arrives yet
    decode.start_tail("q", HEAD, gate)
    injector.start()
    for _ in range(4):  # the tail waits at layer 0; the batch decodes
        outs = decode.step()
        assert [(o.request_id, len(o.new_token_ids)) for o in outs] == [("other", 1)]
        tokens["other"].extend(outs[0].new_token_ids)
    assert decode.tails.num_running == 1
    injector.hold.clear()
    got = _finish(decode, "q", tokens)
    injector.join(30)
    assert injector.error is None, injector.error
    assert got == expected
    assert (tokens["other"], "length") == expected_other
    assert decode.stats().num_free_blocks == 16


def test_an_abort_while_the_tail_computes_frees_the_blocks_once_it_stopped(make_engine):
    params = SamplingParams(temperature=0, max_tokens=6)
    prompt = _prompt(46)
    hook = _head_kv(make_engine, prompt)
    decode = make_engine(block_size=16, num_blocks=16, enable_prefix_caching=True)
    reservation = decode.reserve_remote("q", prompt, params)
    held = decode.stats().num_free_blocks
    gate = LayerGate(len(decode.kv_caches))
    injector = Injector(decode, hook, reservation.slot_mapping, gate)
    injector.hold.set()
    decode.start_tail("q", HEAD, gate)
    injector.start()
    deadline = time.monotonic() + 30
    while not gate.waits:  # the tail waits for the head's first layer
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert decode.abort_request("q")
    assert not decode.abort_request("q")  # once
    # the tail may still write them: the blocks stay held until it stopped
    assert decode.stats().num_free_blocks == held
    tokens, reason = _finish(decode, "q")
    injector.hold.clear()
    injector.join(30)
    assert injector.error is None, injector.error
    assert (tokens, reason) == ([], "abort")
    assert decode.stats().num_free_blocks == 16 and decode.tails.num_running == 0
    hits = decode.stats().prefix_cache_hits
    decode.add_request("again", prompt, params)
    _finish(decode, "again")
    assert decode.stats().prefix_cache_hits == hits


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

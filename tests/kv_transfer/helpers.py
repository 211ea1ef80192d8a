"""Shared by the kv_transfer tests: a recording listener and a transfer driver."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

from kv_transfer.base import KVLayout, KVReceiveListener, KVReceiver, KVSender, TransferTarget


class RecordingListener(KVReceiveListener):
    """Clones every delivered layer and records events per request, in order."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: dict[str, list[tuple]] = {}
        self.layers: dict[tuple[str, int], torch.Tensor] = {}

    def _add(self, request_id: str, event: tuple) -> None:
        with self.cond:
            self.events.setdefault(request_id, []).append(event)
            self.cond.notify_all()

    def on_layer_ready(self, request_id: str, layer: int, kv_view: torch.Tensor) -> None:
        self.layers[(request_id, layer)] = kv_view.clone()
        self._add(request_id, ("layer", layer))

    def on_complete(self, request_id: str, first_token_id: int) -> None:
        self._add(request_id, ("complete", first_token_id))

    def on_failed(self, request_id: str, reason: str) -> None:
        self._add(request_id, ("failed", reason))

    def on_restart(self, request_id: str, reason: str) -> None:
        self._add(request_id, ("restart", reason))

    def wait_event(self, request_id: str, kind: str, timeout: float = 30.0) -> tuple:
        """The first `kind` event of `request_id` (AssertionError on timeout)."""
        def first() -> tuple | None:
            return next((e for e in self.events.get(request_id, []) if e[0] == kind), None)

        with self.cond:
            ok = self.cond.wait_for(lambda: first() is not None, timeout)
            assert ok, f"{request_id} had no {kind}: {self.events.get(request_id)}"
            return first()

    def wait_final(self, request_id: str, timeout: float = 30.0) -> tuple:
        """The complete/failed event of `request_id` (AssertionError on timeout)."""
        with self.cond:
            ok = self.cond.wait_for(lambda: self._final(request_id) is not None, timeout)
            assert ok, f"{request_id} never finished: {self.events.get(request_id)}"
            return self._final(request_id)

    def _final(self, request_id: str) -> tuple | None:
        events = self.events.get(request_id, [])
        return next((e for e in events if e[0] in ("complete", "failed")), None)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def random_kv(layout: KVLayout, generator: torch.Generator) -> torch.Tensor:
    """[L, 2, T, H, D] random values of the layout's dtype."""
    shape = (layout.num_layers, *layout.layer_shape)
    return torch.randn(shape, generator=generator).to(layout.torch_dtype)


def send_all(sender: KVSender, request_id: str, kv: torch.Tensor, cuts: list[int],
             first_token_id: int):  # fmt: skip
    """Send every layer of `kv` in token chunks split at `cuts`; returns END's future."""
    bounds = [0, *cuts, kv.shape[2]]
    for layer in range(kv.shape[0]):
        for a, b in zip(bounds, bounds[1:], strict=False):
            sender.send_layer(request_id, layer, kv[layer, :, a:b].contiguous(), a)
    return sender.end(request_id, first_token_id)


def run_concurrent(sender: KVSender, receiver: KVReceiver, listener: RecordingListener,
                   layouts: list[KVLayout], seed: int,
                   check_pool: bool = True) -> None:  # fmt: skip
    """Send one random transfer per layout from concurrent threads, and assert that
    each arrives byte-exact, layers in order, and that the pool is empty after release."""
    gen = torch.Generator().manual_seed(seed)
    kvs = [random_kv(layout, gen) for layout in layouts]
    ids = [f"req-{seed}-{i}" for i in range(len(layouts))]
    targets = [
        receiver.expect(rid, layout, time.time() + 60)
        for rid, layout in zip(ids, layouts, strict=True)
    ]
    results: dict[str, object] = {}

    def push(i: int) -> None:
        sender.begin(ids[i], targets[i], layouts[i])
        cut = max(1, layouts[i].num_tokens // 3)
        cuts = [cut] if layouts[i].num_tokens > 1 else []
        results[ids[i]] = send_all(sender, ids[i], kvs[i], cuts, 1000 + i).result(60)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(len(layouts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for i, rid in enumerate(ids):
        assert rid in results, f"{rid}: the sending thread died"
        assert results[rid].ok, results[rid]
        assert listener.wait_final(rid) == ("complete", 1000 + i)
        layers = [e[1] for e in listener.events[rid] if e[0] == "layer"]
        assert layers == list(range(layouts[i].num_layers))
        for layer in range(layouts[i].num_layers):
            got = listener.layers[(rid, layer)]
            assert got.dtype == kvs[i].dtype
            assert torch.equal(got.view(torch.uint8), kvs[i][layer].view(torch.uint8))
        assert receiver.release(rid)
    if check_pool:  # only when nothing else uses the receiver meanwhile
        assert receiver.stats().bytes_in_use == 0


# a sender in its own process: sends layer 0 of "victim" and half of layer 1, then
# sleeps until the test kills it with SIGKILL (layout KILLABLE_LAYOUT)
_KILLABLE_SENDER = """
import sys, time, torch
from kv_transfer.base import KVLayout, TransferTarget
from kv_transfer.tcp import TcpKVSender
from kv_transfer.grpc import GrpcKVSender
endpoint, ticket, generation, deadline, transport = sys.argv[1:6]
layout = KVLayout(4, 256, 2, 32, "float32")
target = TransferTarget((endpoint,), bytes.fromhex(ticket), transport, int(generation),
                        float(deadline))
sender = TcpKVSender() if transport == "tcp" else GrpcKVSender()
sender.begin("victim", target, layout)
sender.send_layer("victim", 0, torch.ones(2, 256, 2, 32), 0)
sender.send_layer("victim", 1, torch.ones(2, 100, 2, 32), 0)
print("sent", flush=True)
time.sleep(60)
"""
KILLABLE_LAYOUT = KVLayout(4, 256, 2, 32, "float32")


def start_killable_sender(target: TransferTarget) -> subprocess.Popen:
    """Start the process; it prints "sent" once its frames are queued."""
    return subprocess.Popen(
        [sys.executable, "-c", _KILLABLE_SENDER, target.endpoints[0], target.ticket.hex(),
         str(target.generation), str(target.deadline), target.transport],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip

"""`LayerGate`: the head of a prompt whose KV arrives layer by layer while
this engine computes the tail (the split prefill, docs/architecture.md,
"One prompt on both pods").

The decode pod reserves the request's blocks (`reserve_remote`), starts its
tail with `LLMEngine.start_tail` once the head's first layer is in
(decode_service/kv_import.py), and its injector calls `mark(n)` after
writing the head's KV of layers 0..n-1 into the reserved slots. The
forward that computes the tail calls `wait(layer)` before each layer's
attention reads the cache, so layer l of the tail runs as soon as layer l
of the head has landed, while the prefill pod is still computing the later
layers. `fail()` (the transfer will not
complete) opens every wait: the engine then ends the request aborted after
the step, before its blocks can enter the prefix cache.

Threads: `mark` and `fail` from the injector's thread, `wait` from the
thread that runs forwards; everything under one condition. On CUDA, `mark`
must come after the layer's copy is complete on the device (the injector
synchronises its stream first): the gate orders host threads, not streams.
"""

from __future__ import annotations

import threading


class HeadLost(Exception):
    """Raised by a tail's forward run beside the steps (engine.tail_worker)
    when its gate fails: nothing after that layer is worth computing."""


class LayerGate:
    """How many of the head's layers are in the cache, for one request."""

    __slots__ = ("num_layers", "_cond", "_layers_in", "_failed", "waits")

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._layers_in = 0
        self._failed = False
        self.waits = 0  # calls of `wait` that found their layer not in yet

    @property
    def complete(self) -> bool:
        """Every layer is in, or the gate failed: no wait blocks any more."""
        return self._layers_in >= self.num_layers or self._failed

    @property
    def failed(self) -> bool:
        return self._failed

    def mark(self, layers_in: int) -> None:
        """Layers 0..layers_in-1 of the head are in the cache."""
        if not 0 <= layers_in <= self.num_layers:
            raise ValueError(f"layers_in must be in [0, {self.num_layers}], got {layers_in}")
        with self._cond:
            if layers_in > self._layers_in:
                self._layers_in = layers_in
                self._cond.notify_all()

    def fail(self) -> None:
        """The head will not arrive whole: open every wait."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def wait(self, layer: int) -> bool:
        """Block until layer `layer` of the head is in; False when the gate
        failed (what the caller computes from here on is void)."""
        if self._layers_in > layer:  # the common case once the head is in: no lock
            return True
        with self._cond:
            if self._layers_in <= layer and not self._failed:
                self.waits += 1
                self._cond.wait_for(lambda: self._layers_in > layer or self._failed)
            return not self._failed

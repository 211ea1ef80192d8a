"""`SplitHead`: a split prefill's head on its way into this decode pod
(docs/architecture.md, "One prompt on both pods"), as the injector sees it.

The engine computes the tail on its tail worker while the head's layers
arrive; before each layer's attention the tail waits on the head's
`engine.layer_gate.LayerGate`. The rules the injector keeps for it:

* after each layer is in the cache (on CUDA, its copy complete), the gate
  is marked; after layer 0 the tail starts (`start_tail`, which queues
  `LLMEngine.start_tail` on the engine loop);
* a head that will not all arrive (the transfer failed, or R was forgotten
  before it settled) opens the gate as failed: the tail's forward stops at
  its next layer and the engine aborts R;
* a sender restart fails R outright (`restart_reason`): a restart sends the
  layers again from 0 and overwrites slots the tail may have read already,
  so the router moves R as it moves any failed transfer.

Threads: every method runs on the injector thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.layer_gate import LayerGate
from proto.reasons import SPLIT_HEAD_LOST


@dataclass(frozen=True, slots=True)
class SplitHead:
    """The head's gate and the tail's start (called once, after layer 0)."""

    gate: LayerGate
    start_tail: Callable[[], object]

    def layer_in(self, layers_done: int) -> None:
        """Layers 0..layers_done - 1 are in the cache (on CUDA, copied)."""
        self.gate.mark(layers_done)
        if layers_done == 1:
            self.start_tail()

    def lost(self) -> None:
        """The head will not all arrive: the tail stops at its next gate."""
        self.gate.fail()

    @staticmethod
    def restart_reason(reason: str) -> str:
        """Why R fails when its sender restarts (`reason`: the receiver's)."""
        return f"{SPLIT_HEAD_LOST} ({reason})"

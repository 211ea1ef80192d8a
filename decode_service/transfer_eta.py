"""`TransferETA`: when each KV transfer into this decode pod is expected to
end, for the engine loop's join hold (engine/join_hold.py).

The rule: a transfer's remaining time is the cadence of its injected layers
so far (seconds per layer, known once two are in), times the layers still
to come plus END's lag behind the last layer. END's lag (the prefill pod's
last MLP, final norm and sampling of the first token, and the wire) is
learnt in cadences, as a moving average over completed transfers, starting
at one; a single stalled END counts at most `_END_LAG_MAX`, so it does not
push every later expectation out.

Threads: the injector thread reports each transfer's layers and its end
(`layer_in`, `ended`, `forget`), with the times it read; the engine loop
thread reads `next_ready`. A lock guards the table between the two.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# END's lag behind the last layer, in layers' cadences: where the learnt
# average starts, the weight of each transfer in it, and the most one counts
_END_LAG_START = 1.0
_END_LAG_ALPHA = 0.2
_END_LAG_MAX = 2.0


@dataclass(slots=True)
class _Cadence:
    """One transfer's layers so far."""

    first_at: float
    last_at: float
    layers: int  # layers in
    expected_at: float | None = None  # once two layers are in

    def per_layer(self) -> float:
        return (self.last_at - self.first_at) / (self.layers - 1)


class TransferETA:
    """The decode pod's expectations of its transfers' ends; see the module
    docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transfers: dict[str, _Cadence] = {}
        self._end_lag = _END_LAG_START  # injector thread only

    # ---------------------------------------------------------------- injector thread

    def layer_in(self, request_id: str, layers_done: int, num_layers: int, now: float) -> None:
        """R's layers 0..layers_done - 1 of `num_layers` are in, the last at
        `now` (layer 0 starts R's count afresh, as after a restart)."""
        with self._lock:
            cadence = self._transfers.get(request_id)
            if cadence is None or layers_done == 1:
                cadence = self._transfers[request_id] = _Cadence(now, now, layers_done)
            cadence.last_at = now
            cadence.layers = layers_done
            if layers_done >= 2:
                cadence.expected_at = now + cadence.per_layer() * (
                    num_layers - layers_done + self._end_lag)

    def ended(self, request_id: str, now: float) -> None:
        """R's END was accepted at `now` with every layer in: its commit is
        about to be queued, so nothing waits for it any more, and its lag
        teaches the next expectations."""
        with self._lock:
            cadence = self._transfers.pop(request_id, None)
        if cadence is not None and cadence.layers >= 2 and (per_layer := cadence.per_layer()) > 0:
            lag = (now - cadence.last_at) / per_layer
            self._end_lag += _END_LAG_ALPHA * (min(lag, _END_LAG_MAX) - self._end_lag)

    def forget(self, request_id: str) -> None:
        """R failed, went away, or restarts from layer 0: not expected (until
        its layers come again)."""
        with self._lock:
            self._transfers.pop(request_id, None)

    # ---------------------------------------------------------------- engine loop thread

    def next_ready(self) -> tuple[str, float] | None:
        """The transfer expected to end first and when (`time.monotonic()`),
        or None. A transfer has an expectation once two of its layers are in."""
        best: tuple[str, float] | None = None
        with self._lock:
            for request_id, cadence in self._transfers.items():
                at = cadence.expected_at
                if at is not None and (best is None or at < best[1]):
                    best = (request_id, at)
        return best

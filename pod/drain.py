"""`DrainGate`: admits a pod's RPCs while it serves and counts those in
flight, so shutdown can wait for them (the SERVING -> DRAINING -> STOPPED
path of pod/server.py). Used only on the pod's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Iterator

import grpc

from proto.status import ServiceError


class DrainState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


_TRANSITIONS = {
    DrainState.SERVING: frozenset({DrainState.DRAINING, DrainState.STOPPED}),
    DrainState.DRAINING: frozenset({DrainState.STOPPED}),
    DrainState.STOPPED: frozenset(),
}


class DrainGate:
    """Admits RPCs while SERVING and counts those in flight, so shutdown can
    wait for them. Used only on the pod's event loop (no locking needed)."""

    def __init__(self) -> None:
        self.state = DrainState.SERVING
        self.in_flight = 0
        self._idle: asyncio.Event | None = None

    @property
    def draining(self) -> bool:
        return self.state is not DrainState.SERVING

    def transition(self, new: DrainState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"pod state {self.state.value} -> {new.value} is not allowed")
        self.state = new

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Wrap one RPC's work; UNAVAILABLE once the pod drains."""
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               "pod is shutting down and takes no new requests; use another pod")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no RPC is in flight, False when `timeout` passed first."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

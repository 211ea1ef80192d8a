"""Keeping `pdserve up`'s children running once it serves (pdserve/commands/up.py).

A child that exits after startup (a pod killed, crashed, out of memory) is
restarted with the same arguments on the same ports, so the router's static
pod lists stay right; meanwhile the router routes around it, as it does in a
cluster. Life of one child slot (`SlotState`), checked every 0.2 s on `up`'s
main thread:

    RUNNING  --exited-->  BACKOFF  --backoff over-->  STARTING  --ready file-->  RUNNING
    STARTING --exited, or not ready within the startup timeout (killed)-->  BACKOFF

Backoff: `initial_backoff_s` after the first exit, doubling with every exit
still inside the `window_s`, capped at `max_backoff_s`. An exit
beyond `max_restarts` within `window_s` is not restarted: the child keeps
failing fast, so `up` says so and stops everything (`GiveUp`). Every step is
logged ("pdserve up: prefill-0 exited with status -9; restarting it in 0.5 s").
"""

from __future__ import annotations

import enum
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.commands._children import Child, spawn

# The first restart waits this long; each further exit inside the window doubles it.
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0


class GiveUp(RuntimeError):
    """A child keeps failing: stop everything (the message says which and how often)."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """max_restarts: restarts allowed per child within window_s (0 = never restart:
    the first exit stops everything)."""

    max_restarts: int = 5
    window_s: float = 60.0
    initial_backoff_s: float = INITIAL_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.max_restarts <= 1000:
            raise ValueError(f"--max-restarts must be in 0..1000; got {self.max_restarts}")
        if not 0 < self.window_s <= 86400:
            raise ValueError(f"--restart-window must be in (0, 86400] seconds; "
                             f"got {self.window_s}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("restart backoff: need 0 < initial <= max; got "
                             f"{self.initial_backoff_s}, {self.max_backoff_s}")

    def backoff_s(self, recent_exits: int) -> float:
        """Wait before the restart that follows the `recent_exits`-th exit in the window."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** (recent_exits - 1))


class SlotState(enum.Enum):
    RUNNING = "running"
    BACKOFF = "backoff"
    STARTING = "starting"


@dataclass(slots=True)
class _Slot:
    index: int  # position in the children list, which the restarted child takes over
    state: SlotState = SlotState.RUNNING
    exits: list[float] = field(default_factory=list)  # monotonic times, inside the window
    restart_at: float = 0.0
    restarts: int = 0


class Supervisor:
    """Watches `children` (the list `up` stops at the end; restarted children replace
    their predecessors in it). `respawn(old)` starts a child with old's arguments and
    returns it; `on_ready(child)` returns True once a restarted child serves."""

    def __init__(self, children: list[Child], policy: RestartPolicy,
                 respawn: Callable[[Child], Child], on_ready: Callable[[Child], bool],
                 say: Callable[[str], None]) -> None:  # fmt: skip
        self.children = children
        self.policy = policy
        self._respawn = respawn
        self._on_ready = on_ready
        self._say = say
        self._slots = [_Slot(i) for i in range(len(children))]

    def check(self, now: float | None = None) -> None:
        """One pass over every child; raises GiveUp when one keeps failing."""
        now = time.monotonic() if now is None else now
        for slot in self._slots:
            child = self.children[slot.index]
            if slot.state is SlotState.BACKOFF:
                if now >= slot.restart_at:
                    self._restart(slot, child)
            elif not child.alive():
                self._exited(slot, child, now, f"exited with status {child.process.returncode}")
            elif slot.state is SlotState.STARTING:
                if self._on_ready(child):
                    slot.state = SlotState.RUNNING
                    where = f" on {child.address}" if child.address else ""
                    self._say(f"{child.name} is back{where} (restart {slot.restarts})")
                elif now - child.started_at > self.policy.startup_timeout_s:
                    child.process.send_signal(signal.SIGKILL)
                    child.process.wait()
                    self._exited(slot, child, now, "was not ready within --startup-timeout "
                                                   f"{self.policy.startup_timeout_s:.0f} s")

    def _exited(self, slot: _Slot, child: Child, now: float, what: str) -> None:
        slot.exits = [t for t in slot.exits if now - t < self.policy.window_s] + [now]
        recent = len(slot.exits)
        if recent > self.policy.max_restarts:
            if self.policy.max_restarts == 0:
                raise GiveUp(f"{child.name} {what} (restarts are off: --max-restarts 0)")
            raise GiveUp(f"{child.name} {what}; it exited {recent} times within "
                         f"{self.policy.window_s:.0f} s (--max-restarts "
                         f"{self.policy.max_restarts} per --restart-window), giving up")
        wait = self.policy.backoff_s(recent)
        slot.state = SlotState.BACKOFF
        slot.restart_at = now + wait
        self._say(f"{child.name} {what}; the others keep serving, restarting it in "
                  f"{wait:.1f} s ({recent} exit{'s' if recent > 1 else ''} within "
                  f"{self.policy.window_s:.0f} s)")

    def _restart(self, slot: _Slot, old: Child) -> None:
        slot.restarts += 1
        where = f" on {old.address}" if old.address else ""
        self._say(f"restarting {old.name}{where} (restart {slot.restarts})")
        self.children[slot.index] = self._respawn(old)
        slot.state = SlotState.STARTING


def supervise(children: list[Child], policy: RestartPolicy, say: Callable[[str], None]) -> None:
    """`up`'s watch loop: returns never; raises GiveUp (or the signal's exception)."""

    def respawn(old: Child) -> Child:
        child = spawn(old.name, old.argv, old.workdir, old.ready_file)
        child.address, child.metrics_port = old.address, old.metrics_port
        return child

    def ready(child: Child) -> bool:
        return child.ready_file is not None and child.ready_file.is_file()

    supervisor = Supervisor(children, policy, respawn, ready, say)
    while True:
        supervisor.check()
        time.sleep(0.2)
